"""Cheap deterministic token estimates and filler text, shared by the simulator and the load generator."""

from __future__ import annotations

CHARS_PER_TOKEN = 4
# Chat templates wrap every message in role markers; a few tokens per message plus the assistant header.
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_PER_PROMPT = 3

# Each filler word is one token: a space plus three letters, so text of n filler words estimates to n tokens.
FILLER_WORDS = tuple(f" {w}" for w in (
    "the and for are but not you all any can had her was one our out day get has him his how man new now old see "
    "two way who boy did its let put say she too use art bad big box car cat cup dog eat end far fun hot map net "
    "pen red run sea sun top war yes zip"
).split())


def estimate_text_tokens(text: str) -> int:
    """Token count of a completion prompt: about four UTF-8 bytes per token (a character of English, a token per
    CJK character: as real tokenizers give, within ~1.4x), at least one."""
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return max(1, -(-size // CHARS_PER_TOKEN))


def estimate_chat_tokens(messages: list[dict]) -> int:
    """Token count of a chat prompt: each message's content plus the template's per-message overhead."""
    total = CHAT_TOKENS_PER_PROMPT
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts: count the text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        total += CHAT_TOKENS_PER_MESSAGE + (estimate_text_tokens(content) if content else 0)
    return total


def filler_text(n_tokens: int, offset: int = 0) -> str:
    """Text that estimates to exactly n_tokens tokens (n_tokens filler words)."""
    words = FILLER_WORDS
    count = len(words)
    return "".join(words[(offset + i) % count] for i in range(max(0, n_tokens)))


def chat_content_tokens(prompt_tokens: int) -> int:
    """Content tokens for a one-message chat whose whole prompt estimates to prompt_tokens."""
    return max(1, prompt_tokens - CHAT_TOKENS_PER_MESSAGE - CHAT_TOKENS_PER_PROMPT)
