"""Chat formats the drafters never saw in training, rendered from held-out conversations.

Training renders every conversation with the target's own chat template (`<|user|>\\n...<|end|>\\n`). A
user who serves the same target behind another front end sends other text: other markup, other role names,
a system prompt, other whitespace. Each format here is one such change, applied to the same conversations,
so acceptance can be compared format by format (issue 14: the paper's "chat-template perturbation").
Every renderer ends with the assistant cue, so the target's reply follows.
"""

from __future__ import annotations

SYSTEM_ODD = "You are a pirate. Answer every question in pirate speak, briefly."
SYSTEM_KIOSK = "SYSTEM NOTICE: you are the help kiosk of a hospital. keep answers short. no lists."


def _turns(messages, user: str, assistant: str, sep: str, end: str = "") -> str:
    names = {"user": user, "assistant": assistant}
    return "".join(f"{names[m['role']]}{sep}{m['content']}{end}" for m in messages if m["role"] in names)


def chatml(messages) -> str:
    """ChatML (Qwen and others) with a system prompt: new markup and a system turn."""
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return f"<|im_start|>system\n{SYSTEM_ODD}<|im_end|>\n{body}<|im_start|>assistant\n"


def llama3(messages) -> str:
    """Llama-3 header markup, no system prompt."""
    body = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in messages)
    return f"<|begin_of_text|>{body}<|start_header_id|>assistant<|end_header_id|>\n\n"


def human_response(messages) -> str:
    """'### Human:' / '### Response:' with an unusual system line (plain-text roles)."""
    return f"{SYSTEM_KIOSK}\n\n" + _turns(messages, "### Human:", "### Response:", " ", "\n\n") + "### Response:"


def vicuna(messages) -> str:
    """USER: / ASSISTANT: on one line each, a one-line preamble."""
    head = "A chat between a curious user and an assistant.\n"
    return head + _turns(messages, "USER:", "ASSISTANT:", " ", "\n") + "ASSISTANT:"


def own_roles_renamed(messages) -> str:
    """The target's own markup with other role names (customer / agent): a role-name change only."""
    return _turns(messages, "<|customer|>", "<|agent|>", "\n", "<|end|>\n") + "<|agent|>\n"


def own_system_prompt(messages) -> str:
    """The target's own template plus a system turn it never had in training: a system-prompt change only."""
    return f"<|system|>\n{SYSTEM_KIOSK}<|end|>\n" + _turns(messages, "<|user|>", "<|assistant|>", "\n", "<|end|>\n") \
        + "<|assistant|>\n"  # fmt: skip


def own_whitespace(messages) -> str:
    """The target's own markup with markdown emphasis, blank lines and indentation: a whitespace/markup change."""
    body = "".join(f"<|{m['role']}|>\n\n  **{m['content']}**\n\n<|end|>\n\n" for m in messages)
    return body + "<|assistant|>\n\n  "


FORMATS = {f.__name__: f for f in (chatml, llama3, human_response, vicuna, own_roles_renamed, own_system_prompt,
                                   own_whitespace)}  # fmt: skip
