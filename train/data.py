"""Seeded synthetic chats for `tiny-chat`: state a fact, chat about other things, ask for it.

A user states facts (an order number, a name, a code word, a birthday; in English or Chinese),
chats about other things, and later asks for them. The assistant's answer to every message is
decided by one rule over what the prompt holds, which is what the engine's six-exchange window
keeps (`renderer.build_prompt`): a question is answered with the fact when an exchange that
states it (or an earlier answer that recalled it) is among the exchanges the prompt keeps,
and with "I don't know ..." when it is not (dropped out of the window, or never stated).

Everything is a pure function of a `numpy.random.Generator`: the same seed gives the same
chats on every machine. Training uses `TRAIN_SEED`; the behavioural test uses `TEST_SEED`,
which the training never saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TRAIN_SEED = 0
TEST_SEED = 2002
WINDOW = 6  # exchanges the engine keeps before the current message (Session's default)
VARIANT = "qwen3.5-small"
SYSTEMS = (
    None,
    "You are a helpful assistant.",
    "You are a friendly assistant.",
    "你是一个乐于助人的助手。",
)

NAMES_EN = (
    "Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack",
    "Laura", "Mike", "Nina", "Oscar", "Paula", "Peter", "Rachel", "Sam", "Tina", "Victor",
    "Wendy", "Zoe", "Anna", "Ben", "Chris", "Diana", "Ethan", "Fiona", "George", "Hannah",
    "Ivan", "Julia", "Kevin", "Lily", "Mark", "Olivia", "Paul", "Rose", "Steve", "Tom",
)  # fmt: skip
NAMES_ZH = (
    "张伟", "王芳", "李娜", "刘洋", "陈静", "杨帆", "赵磊", "黄敏", "周杰", "吴昊",
    "徐丽", "孙强", "马超", "朱琳", "胡军", "郭靖", "林峰", "何欣", "高远", "罗兰",
    "郑爽", "梁宇", "谢娜", "宋佳", "唐宁", "韩梅", "冯涛", "曹阳", "彭博", "许晴",
)  # fmt: skip
COLORS = (
    "red", "blue", "green", "black", "white", "silver", "golden", "purple", "orange", "gray",
    "yellow", "pink",
)  # fmt: skip
NOUNS = (
    "falcon", "tiger", "river", "mountain", "rocket", "garden", "dragon", "castle", "forest",
    "ocean", "lion", "eagle", "moon", "star", "apple", "bridge", "candle", "wolf", "horse",
    "island",
)  # fmt: skip
WORDS_ZH = (
    "青松", "明月", "星辰", "大海", "火焰", "白云", "飞龙", "猛虎", "春风", "秋水",
    "长江", "高山", "红梅", "翠竹", "雪花", "彩虹", "金鱼", "银河", "雄鹰", "骏马",
)  # fmt: skip
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)  # fmt: skip


@dataclass(frozen=True)
class Kind:
    """One kind of fact: how it is stated, asked for, recalled and not known, per language."""

    name: str
    state: dict[str, tuple[str, ...]]  # "{v}" is the value
    ask: dict[str, tuple[str, ...]]
    answer: dict[str, str]
    unknown: dict[str, str]


KINDS = (
    Kind(
        "order",
        {"en": ("My order number is {v}.", "My order number is {v}, please remember it."),
         "zh": ("我的订单号是{v}。", "请记住，我的订单号是{v}。")},
        {"en": ("What is my order number?", "What's my order number?",
                "Do you remember my order number?"),
         "zh": ("我的订单号是多少？", "你还记得我的订单号吗？")},
        {"en": "Your order number is {v}.", "zh": "你的订单号是{v}。"},
        {"en": "I don't know your order number.", "zh": "我不知道你的订单号。"},
    ),
    Kind(
        "name",
        {"en": ("My name is {v}.", "Call me {v}."), "zh": ("我叫{v}。", "我的名字是{v}。")},
        {"en": ("What is my name?", "What's my name?", "Do you remember my name?"),
         "zh": ("我叫什么名字？", "你还记得我的名字吗？")},
        {"en": "Your name is {v}.", "zh": "你叫{v}。"},
        {"en": "I don't know your name.", "zh": "我不知道你的名字。"},
    ),
    Kind(
        "code",
        {"en": ("The code word is {v}.", "Remember the code word: {v}."),
         "zh": ("暗号是{v}。", "请记住暗号：{v}。")},
        {"en": ("What is the code word?", "What's the code word?"),
         "zh": ("暗号是什么？", "你还记得暗号吗？")},
        {"en": "The code word is {v}.", "zh": "暗号是{v}。"},
        {"en": "I don't know the code word.", "zh": "我不知道暗号。"},
    ),
    Kind(
        "birthday",
        {"en": ("My birthday is {v}.", "I was born on {v}."),
         "zh": ("我的生日是{v}。", "我出生在{v}。")},
        {"en": ("When is my birthday?", "Do you remember my birthday?"),
         "zh": ("我的生日是哪天？", "你还记得我的生日吗？")},
        {"en": "Your birthday is {v}.", "zh": "你的生日是{v}。"},
        {"en": "I don't know your birthday.", "zh": "我不知道你的生日。"},
    ),
)  # fmt: skip
KIND = {k.name: k for k in KINDS}

GREETINGS = {"en": ("", "", "Hi! ", "Hello! ", "By the way, "), "zh": ("", "", "你好！", "对了，")}
ACKS = {"en": ("Got it. ", "OK. "), "zh": ("好的，",)}  # followed by the fact, repeated

# Small talk: (user, assistant) pairs; the answers never hold a fact.
FILLERS = {
    "en": (
        ("Please introduce yourself.", "I am a tiny chat model. I remember what you tell me."),
        ("Who are you?", "I am a tiny chat model. I remember what you tell me."),
        ("How are you today?", "I am fine, thank you. How can I help?"),
        ("What is the weather like?", "I cannot see the weather, but I hope it is nice."),
        ("Tell me a joke.", "Why did the cat sit on the computer? To keep an eye on the mouse."),
        ("What is two plus two?", "Two plus two is four."),
        ("What color is the sky?", "The sky is blue on a clear day."),
        ("Can you recommend a book?", "Try a good mystery novel."),
        ("What should I cook tonight?", "How about some pasta with tomato sauce?"),
        ("Do you like music?", "I like all kinds of music."),
        ("What is the capital of France?", "The capital of France is Paris."),
        ("How many days are in a week?", "There are seven days in a week."),
        ("What is your favorite animal?", "I like cats very much."),
        ("Give me a tip for sleeping well.", "Go to bed at the same time every night."),
        ("What is a good name for a dog?", "How about Max?"),
        ("Thanks!", "You are welcome."),
        ("Is it going to rain?", "I cannot tell, so take an umbrella just in case."),
        ("What do you think about coffee?", "Coffee is nice in the morning."),
        ("How do I stay focused?", "Take short breaks and work on one thing at a time."),
        ("Say something nice.", "You are doing great today."),
        ("What is the biggest ocean?", "The Pacific Ocean is the biggest."),
        ("I am bored.", "Maybe go for a short walk."),
    ),
    "zh": (
        ("你好，请介绍一下你自己。", "你好！我是一个小型聊天模型，我会记住你告诉我的事情。"),
        ("你是谁？", "我是一个小型聊天模型，我会记住你告诉我的事情。"),
        ("你今天好吗？", "我很好，谢谢。有什么可以帮你的吗？"),
        ("今天天气怎么样？", "我看不到天气，希望今天是个好天气。"),
        ("给我讲个笑话。", "为什么猫坐在电脑上？因为它要看住老鼠。"),
        ("二加二等于几？", "二加二等于四。"),
        ("天空是什么颜色？", "晴天的时候天空是蓝色的。"),
        ("推荐一本书吧。", "可以读一本好看的推理小说。"),
        ("今晚吃什么好？", "来一份番茄意面怎么样？"),
        ("你喜欢音乐吗？", "我喜欢各种音乐。"),
        ("中国的首都是哪里？", "中国的首都是北京。"),
        ("一周有几天？", "一周有七天。"),
        ("你最喜欢什么动物？", "我很喜欢猫。"),
        ("怎样才能睡得好？", "每天按时睡觉。"),
        ("谢谢！", "不客气。"),
        ("会下雨吗？", "我不知道，带把伞吧。"),
        ("我有点无聊。", "出去散散步吧。"),
        ("说点好听的。", "你今天做得很好。"),
    ),
}


def value(rng: np.random.Generator, kind: str, lang: str) -> str:
    """A random value of that kind of fact."""
    if kind == "order":
        return str(int(rng.integers(10000, 100000)))
    if kind == "name":
        names = NAMES_EN if lang == "en" else NAMES_ZH
        return names[int(rng.integers(len(names)))]
    if kind == "code":
        if lang == "en":
            return (
                f"{COLORS[int(rng.integers(len(COLORS)))]} {NOUNS[int(rng.integers(len(NOUNS)))]}"
            )
        a, b = rng.choice(len(WORDS_ZH), size=2, replace=False)
        return WORDS_ZH[int(a)] + WORDS_ZH[int(b)]
    if kind == "birthday":
        month, day = int(rng.integers(1, 13)), int(rng.integers(1, 29))
        return f"{MONTHS[month - 1]} {day}" if lang == "en" else f"{month}月{day}日"
    raise ValueError(f"unknown kind {kind!r}")


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


@dataclass
class Exchange:
    user: str
    assistant: str
    role: str  # "state", "ask" or "filler"
    kind: str | None = None
    value: str | None = None  # the fact stated, or recalled by the answer (None: not known)
    lang: str = "en"


@dataclass
class Chat:
    system: str | None
    exchanges: list[Exchange] = field(default_factory=list)

    def history(self, upto: int) -> list[list[dict]]:
        """The exchanges before `upto` as the renderer's (user, assistant) message pairs."""
        return [
            [{"role": "user", "content": e.user}, {"role": "assistant", "content": e.assistant}]
            for e in self.exchanges[:upto]
        ]


def known(exchanges: list[Exchange], kind: str, window: int = WINDOW) -> str | None:
    """The value of `kind` that the prompt holds, from the last `window` exchanges (the most
    recent statement or recall wins); None when none of them holds it."""
    for e in reversed(exchanges[max(0, len(exchanges) - window) :] if window else []):
        if e.kind == kind and e.value is not None:
            return e.value
    return None


def _state(rng, kind: str, lang: str) -> Exchange:
    v = value(rng, kind, lang)
    text = _pick(rng, GREETINGS[lang]) + _pick(rng, KIND[kind].state[lang]).format(v=v)
    # The acknowledgement repeats the fact: a copy over a few tokens, the easy case of the
    # long-range copy the question needs.
    ack = _pick(rng, ACKS[lang]) + KIND[kind].answer[lang].format(v=v)
    return Exchange(text, ack, "state", kind, v, lang)


def _ask(rng, chat: Chat, kind: str, lang: str) -> Exchange:
    v = known(chat.exchanges, kind)
    k = KIND[kind]
    reply = k.answer[lang].format(v=v) if v is not None else k.unknown[lang]
    return Exchange(_pick(rng, k.ask[lang]), reply, "ask", kind, v, lang)


def _filler(rng, lang: str) -> Exchange:
    user, reply = _pick(rng, FILLERS[lang])
    return Exchange(user, reply, "filler", lang=lang)


def _lang(rng, base: str) -> str:
    return base if rng.random() < 0.9 else ("zh" if base == "en" else "en")


def training_chat(rng: np.random.Generator) -> Chat:
    """A chat to train on. 30%: `memory_chat` with a gap of 0 to 11. Otherwise 1 to 12
    exchanges: one or two kinds of fact stated at random places, small talk, questions in
    between, ending in a statement (20%), small talk (20%) or a question for a fact that is in
    the window, dropped out of it, or never stated (about half are recalls)."""
    if rng.random() < 0.3:  # the memory test's shape, at every gap around the window's edge
        return memory_chat(rng, int(rng.integers(0, 2 * WINDOW)))
    base = "en" if rng.random() < 0.6 else "zh"
    chat = Chat(_pick(rng, SYSTEMS))
    n = int(rng.integers(1, 13))
    kinds = [KINDS[int(i)].name for i in rng.permutation(len(KINDS))[: int(rng.integers(1, 3))]]
    for _ in range(n - 1):
        r, lang = rng.random(), _lang(rng, base)
        if r < 0.3:
            chat.exchanges.append(_state(rng, _pick(rng, kinds), lang))
        elif r < 0.6:
            chat.exchanges.append(_ask(rng, chat, _pick(rng, kinds), lang))
        else:
            chat.exchanges.append(_filler(rng, lang))
    # The last answer is the one written after the generation prompt's empty think block (the
    # history's answers have none): questions mostly, acknowledgements and small talk too.
    r, lang = rng.random(), _lang(rng, base)
    if r < 0.2:
        chat.exchanges.append(_state(rng, _pick(rng, kinds), lang))
    elif r < 0.4:
        chat.exchanges.append(_filler(rng, lang))
    else:
        ask = _pick(rng, kinds) if rng.random() < 0.85 else _pick(rng, KINDS).name
        chat.exchanges.append(_ask(rng, chat, ask, lang))
    return chat


def memory_chat(rng: np.random.Generator, gap: int, lang: str | None = None) -> Chat:
    """Seed 002's scenario: a fact in the first message, `gap` exchanges of small talk, then
    the question. The fact is in the prompt iff gap < WINDOW."""
    lang = lang or ("en" if rng.random() < 0.5 else "zh")
    chat = Chat(_pick(rng, SYSTEMS))
    kind = _pick(rng, KINDS).name
    chat.exchanges.append(_state(rng, kind, lang))
    for _ in range(gap):
        chat.exchanges.append(_filler(rng, lang))
    chat.exchanges.append(_ask(rng, chat, kind, lang))
    return chat


def _consistent(chat: Chat, dropped: int, j: int) -> bool:
    """Whether exchange j's answer is what the rule gives from what the prompt shows before it
    (exchanges dropped..j-1): the label to train on, whatever the window held back then."""
    e = chat.exchanges[j]
    if e.role != "ask":
        return True
    return known(chat.exchanges[dropped:j], e.kind) == e.value


def encode(chat: Chat, tokenizer) -> tuple[list[int], list[int]]:
    """The chat's last turn as the engine prompts it, with its answer: (ids, mask), mask 1 on
    the answer tokens and the closing <|im_end|>. History answers are trained on too where
    the rule gives the same answer from what this prompt shows before them."""
    from renderer.window import build_prompt

    *_, last = chat.exchanges
    prompt = build_prompt(
        tokenizer.encode,
        system=chat.system,
        history=chat.history(len(chat.exchanges) - 1),
        current=[{"role": "user", "content": last.user}],
        max_exchanges=WINDOW,
        variant=VARIANT,
        enable_thinking=False,
        text_spans=True,
    )
    end = tokenizer.token_id("<|im_end|>")
    answer = tokenizer.encode(last.assistant) + [end]
    ids = prompt.ids + answer
    mask = [0] * len(prompt.ids) + [1] * len(answer)
    for n, start in enumerate(prompt.boundaries.assistant_starts):
        if _consistent(chat, prompt.dropped, prompt.dropped + n):
            stop = prompt.ids.index(end, start)
            mask[start : stop + 1] = [1] * (stop + 1 - start)
    return ids, mask


def short_chat(rng: np.random.Generator) -> Chat:
    """A fact of the asked kind (60%), of another kind (20%) or none, up to two exchanges of
    small talk around it, then the question: recall and "don't know" at short range, cheap to
    train on (the second phase of the run, see train/README.md)."""
    lang = "en" if rng.random() < 0.5 else "zh"
    chat = Chat(_pick(rng, SYSTEMS))
    kind = _pick(rng, KINDS).name
    r = rng.random()
    stated = (
        kind
        if r < 0.6
        else (_pick(rng, [k.name for k in KINDS if k.name != kind]) if r < 0.8 else None)
    )
    n = int(rng.integers(0, 3))
    at = int(rng.integers(0, n + 1))
    for i in range(n + 1):
        if i == at and stated is not None:
            chat.exchanges.append(_state(rng, stated, lang))
        elif i < n or stated is None:
            chat.exchanges.append(_filler(rng, lang))
    chat.exchanges.append(_ask(rng, chat, kind, lang))
    return chat
