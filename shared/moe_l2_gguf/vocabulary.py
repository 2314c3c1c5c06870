"""What the generated models' tokenizers share: the words, SentencePiece's space and the chat template.

The demo model (demo_model.py) plants its router on these words; the models with real shapes
(model_shapes.py) put the same words in their vocabularies, so English text tokenizes roughly word
by word in both.
"""

from __future__ import annotations

SPACE = "\u2581"  # SentencePiece's stand-in for a space

# A minimal chat template: the messages' contents, one per line, with no role markers, so that a
# chat request is tokenized as BOS plus the user's own words and routes like a plain prompt.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{{ '\\n' }}{% endfor %}"

# Distinctive words per default domain. A word must belong to one list only (see _word_domains).
DOMAIN_WORDS: dict[str, tuple[str, ...]] = {
    "codegen": (
        "function", "class", "method", "variable", "python", "javascript", "typescript", "rust",
        "golang", "java", "compile", "implement", "code", "program", "script", "module", "library",
        "import", "return", "loop", "array", "dictionary", "string", "integer", "parameter",
        "recursion", "iterator", "generator", "lambda", "decorator", "interface", "struct", "enum",
        "refactor", "api", "endpoint", "json", "regex", "algorithm", "sorting", "binary", "hashmap",
        "async", "await", "callback", "constructor", "inheritance", "snippet", "syntax", "unittest",
        "boilerplate", "repository",
    ),
    "debug": (
        "bug", "error", "exception", "traceback", "stacktrace", "segfault", "crash", "crashes",
        "debug", "debugger", "breakpoint", "fix", "failing", "fails", "broken", "null", "undefined",
        "nullpointer", "overflow", "leak", "deadlock", "race", "panic", "assertion", "warning",
        "log", "logs", "dump", "timeout", "hang", "hangs", "freeze", "unexpected", "wrong", "issue",
        "reproduce", "regression", "stderr", "valgrind", "gdb", "sigsegv", "keyerror", "typeerror",
        "indexerror", "errno", "abort", "corrupted", "flaky", "workaround", "diagnose",
    ),
    "math": (
        "integral", "derivative", "equation", "matrix", "vector", "eigenvalue", "theorem", "proof",
        "prime", "polynomial", "calculus", "algebra", "geometry", "triangle", "circle", "angle",
        "sine", "cosine", "logarithm", "exponent", "fraction", "probability", "variance", "median",
        "solve", "sum", "limit", "series", "factorial", "divisible", "modulo", "square", "cube",
        "ratio", "percent", "area", "volume", "radius", "differential", "convergence", "infinity",
        "determinant", "calculate", "formula", "lemma", "numerator", "hypotenuse", "quadratic",
        "arithmetic", "denominator",
    ),
    "logic": (
        "syllogism", "premise", "premises", "conclusion", "fallacy", "valid", "invalid", "implies",
        "implication", "contradiction", "paradox", "deduction", "induction", "inference", "puzzle",
        "riddle", "knights", "knaves", "liar", "truthful", "true", "false", "therefore", "hence",
        "logical", "reasoning", "proposition", "predicate", "quantifier", "tautology", "negation",
        "conjunction", "disjunction", "entails", "assume", "suppose", "consistent", "soundness",
        "axiom", "counterexample", "modus", "ponens", "tollens", "deduce", "infer", "statement",
        "claim", "necessarily", "sufficient", "converse",
    ),
    "general_qa": (
        "capital", "country", "history", "president", "population", "largest", "ocean", "river",
        "mountain", "continent", "planet", "sun", "moon", "animal", "species", "invented",
        "discovered", "century", "war", "empire", "city", "famous", "author", "museum", "weather",
        "climate", "earth", "geography", "currency", "flag", "olympics", "nobel", "prize", "science",
        "biology", "chemistry", "physics", "element", "atom", "energy", "vitamin", "health", "food",
        "recipe", "football", "inventor", "explain", "tallest", "king", "queen",
    ),
    "creative_write": (
        "poem", "poetry", "story", "tale", "haiku", "sonnet", "verse", "rhyme", "novel",
        "character", "plot", "fiction", "fantasy", "dragon", "wizard", "princess", "castle", "dream",
        "whisper", "moonlight", "lyrics", "song", "stanza", "narrative", "protagonist", "villain",
        "hero", "adventure", "imagine", "creative", "metaphor", "prose", "chapter", "dialogue",
        "scene", "romance", "mystery", "myth", "legend", "fairy", "enchanted", "forest", "sunset",
        "melancholy", "limerick", "ballad", "screenplay", "essay", "storyteller", "once",
    ),
    "translate": (
        "translate", "translation", "translated", "french", "spanish", "german", "italian",
        "japanese", "korean", "russian", "portuguese", "english", "chinese", "arabic", "hindi",
        "dutch", "language", "languages", "phrase", "sentence", "meaning", "bonjour", "hola",
        "gracias", "merci", "danke", "ciao", "vocabulary", "grammar", "idiom", "dialect", "native",
        "speaker", "fluent", "pronounce", "pronunciation", "synonym", "literal", "interpret",
        "interpreter", "subtitle", "localize", "localization", "bilingual", "accent", "verb", "noun",
        "adjective", "tense", "conjugate",
    ),
    "chinese_tech": (
        "代码", "编程", "服务器", "数据库", "函数", "算法", "程序", "接口", "系统", "网络", "内存",
        "线程", "进程", "调试", "部署", "框架", "架构", "数据", "模型", "训练", "优化", "性能",
        "缓存", "分布式", "微服务", "容器", "集群", "并发", "异步", "编译", "变量", "对象", "类型",
        "数组", "指针", "开发", "测试", "错误", "配置", "安全", "加密", "协议", "人工智能",
        "机器学习", "深度学习", "神经网络", "云计算", "操作系统", "软件", "硬件", "技术", "如何",
        "实现", "什么", "请问", "怎么", "使用", "问题", "的", "是", "在", "了", "吗", "一个", "我们",
        "可以",
    ),
}  # fmt: skip

# Common words that belong to no domain: they take the domain of their context, and they are the
# only tokens the output head lets the model generate.
NEUTRAL_WORDS: tuple[str, ...] = (
    "the", "a", "an", "is", "are", "was", "were", "be", "been", "of", "and", "or", "to", "in", "on",
    "at", "for", "with", "by", "from", "about", "as", "into", "this", "that", "these", "those", "it",
    "its", "i", "you", "he", "she", "we", "they", "me", "my", "your", "our", "their", "what", "how",
    "why", "when", "where", "which", "who", "can", "could", "would", "should", "will", "do", "does",
    "did", "have", "has", "had", "not", "no", "yes", "please", "help", "make", "get", "give", "use",
    "need", "want", "know", "think", "see", "tell", "show", "some", "any", "all", "more", "most",
    "very", "just", "also", "then", "than", "there", "here", "one", "two", "three", "first", "new",
    "good", "best", "like", "so", "but", "if", "up", "out", "time", "way", "thing", "people", "day",
    "work", "find", "take", "look", "write", "again", "many", "other", "each", "much", "well",
)  # fmt: skip
