"""The Redis edge: carpool's own keys and the scripts that move requests through them."""


def reply_text(value: bytes | str) -> str:
    """A Redis reply (a key, a field, a member) as text, whether the client decodes replies or not."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
