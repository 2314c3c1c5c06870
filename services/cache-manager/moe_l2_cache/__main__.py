import sys

from moe_l2_common.placeholder import not_built

sys.exit(not_built("cache-manager"))
