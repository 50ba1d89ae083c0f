"""The scripted conversation the replay benchmark plays: mixed English and Chinese.

Facts are planted early (an order number, a code word) and asked about later, lengths vary
from a few words to a long pasted document, and the conversation runs past the six-exchange
window, so later turns trim the oldest exchanges. Only the user side is scripted: the answers
are whatever the model generates.
"""

from __future__ import annotations

SYSTEM = (
    "You are a helpful, concise assistant for an online shop. Answer in the language of the "
    "question. Keep track of the details the customer gives you (order numbers, code words, "
    "addresses) and use them when asked later. 你是一个乐于助人的购物助手。"
)

_REPORT_EN = (
    "Incident report, warehouse 7, night shift. At 02:14 the conveyor on line B stopped after "
    "a jammed carton triggered the safety sensor. The operator cleared the jam, restarted the "
    "line at 02:31 and logged seventeen delayed parcels, among them several express orders "
    "bound for Hamburg, Lyon and Milan. At 03:05 a forklift battery warning appeared; the "
    "vehicle was parked and swapped for the spare. No injuries. The scanner at gate 3 misread "
    "barcodes printed on glossy labels, so twelve parcels were scanned by hand. "
)
_REPORT_ZH = (
    "夜班报告：七号仓库在凌晨两点十四分因纸箱卡住触发安全传感器，B线传送带停止运行。操作员清除"
    "卡箱后于两点三十一分重新启动，共有十七个包裹延误，其中包括发往汉堡、里昂和米兰的加急订单。"
    "三点零五分叉车电池报警，车辆已停放并更换备用电池。无人受伤。三号门扫描器无法识别光面标签上"
    "的条形码，十二个包裹改为人工扫描。"
)

# A pasted document of roughly 1,000 tokens: long enough that, once it sits in the window, the
# prompt grows by a large block, and that dropping it later frees most of the prompt.
LONG_DOCUMENT = (
    "Please read this whole shift log and summarise the three most important problems, in "
    "English and then in Chinese.\n\n" + (_REPORT_EN + "\n" + _REPORT_ZH + "\n") * 4
)

USER_TURNS: list[str] = [
    "Hi! My order number is 48213 and the code word for my account is BLUEBIRD.",
    "我想把收货地址改成上海市浦东新区世纪大道100号，可以吗？",
    "What is my order number?",
    "Can you explain the difference between standard and express shipping in two sentences?",
    "我的账户暗号是什么？",
    "Thanks. Could you also list three ways to pack fragile glassware safely?",
    LONG_DOCUMENT,
    "请用一句话总结刚才的报告。",
    "Which cities had express orders delayed?",
    "Short question: do you ship to Norway?",
    "如果包裹丢了，我应该怎么办？请分步骤说明。",
    "What was my code word again? And my order number?",
    "Write a two-line poem about a parcel travelling by night train.",
    "把上面的诗翻译成中文。",
    "How long do refunds usually take for card payments?",
    "Ok.",
    "我想再确认一下：订单号和收货地址分别是什么？",
    "Please draft a polite email asking the warehouse to re-scan parcels with glossy labels, "
    "mentioning gate 3 and the twelve parcels scanned by hand.",
    "谢谢你的帮助！最后一个问题：周末客服几点上班？",
    "Summarise our whole conversation in three bullet points.",
]


def user_turns(n: int) -> list[str]:
    """The first `n` scripted messages (cycled if more are asked for)."""
    return [USER_TURNS[i % len(USER_TURNS)] for i in range(n)]
