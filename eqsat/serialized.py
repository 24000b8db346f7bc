"""The serialized e-graph: what crosses from the e-graph (`eqsat.saturate.serialized_data`) into
extraction (`extract.load`), as the dict of egglog's `_serialize()`: nodes, their e-classes and
children, and each class's sort."""

from __future__ import annotations

import json


def parse_serialized(serialized) -> dict:
    """The dict of `egraph._serialize()`, of its `.to_json()` text, or the dict itself (orjson reads
    the text when it is installed: about three times faster than `json` on a large e-graph)."""
    if hasattr(serialized, "to_json"):
        serialized = serialized.to_json()
    if not isinstance(serialized, (str, bytes)):
        return serialized
    try:
        import orjson
    except ImportError:
        return json.loads(serialized)
    return orjson.loads(serialized)
