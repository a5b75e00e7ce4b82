"""Seeded random mutations of a recorded JSON request body, for fuzzing the server with what real clients send
made slightly wrong: a field dropped, duplicated or given a value of another JSON type, anywhere in the tree.
"""
from __future__ import annotations

import json
import random
from typing import Any

# one value of each JSON type: a retyped field gets one whose type differs from its own
_VALUES_BY_TYPE = {dict: {"x": 1}, list: [1, "x"], str: "x", bool: True, int: -1, float: 1e300, type(None): None}


def _type(value: Any) -> type:
    return type(value) if type(value) in _VALUES_BY_TYPE else dict


def _children(node: Any) -> list:
    return list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []


def _random_place(tree: Any, rng: random.Random) -> tuple | None:
    """A field (dict key) or element (list index) reached by a random walk down from the top, stopping at each
    level with even odds: the top-level fields get half the mutations, instead of next to none among the
    thousands of leaves of an agent's tools and messages."""
    path: tuple = ()
    node = tree
    while True:
        keys = _children(node)
        if not keys:
            return path or None
        key = rng.choice(keys)
        path, node = path + (key,), node[key]
        if not _children(node) or rng.random() < 0.5:
            return path


def _parent(tree: Any, path: tuple) -> Any:
    for key in path[:-1]:
        tree = tree[key]
    return tree


def _encode(node: Any, duplicate: tuple | None, path: tuple = ()) -> str:
    """JSON text of the tree; the field at `duplicate` is written twice (the second time with another type's
    value), as a hand-written client might: most parsers keep the last, some refuse it."""
    if isinstance(node, dict):
        parts = []
        for key, child in node.items():
            parts.append(f"{json.dumps(key)}: {_encode(child, duplicate, path + (key,))}")
            if duplicate == path + (key,):
                other = next(v for t, v in _VALUES_BY_TYPE.items() if t is not _type(child))
                parts.append(f"{json.dumps(key)}: {json.dumps(other)}")
        return "{" + ", ".join(parts) + "}"
    if isinstance(node, list):
        return "[" + ", ".join(_encode(child, duplicate, path + (i,)) for i, child in enumerate(node)) + "]"
    return json.dumps(node)


def mutate(body: dict, rng: random.Random) -> tuple[str, bytes]:
    """One mutation of `body` (left unchanged): (what was done, the new JSON text as bytes)."""
    tree = json.loads(json.dumps(body))
    path = _random_place(tree, rng)
    if path is None:
        return "nothing to mutate", json.dumps(tree).encode()
    parent, key = _parent(tree, path), path[-1]
    kind = rng.choice(("drop", "duplicate", "retype"))
    if kind == "drop":
        del parent[key]
        return f"dropped {list(path)}", json.dumps(tree).encode()
    if kind == "duplicate":
        if isinstance(parent, list):
            parent.insert(key, json.loads(json.dumps(parent[key])))
            return f"duplicated element {list(path)}", json.dumps(tree).encode()
        return f"duplicated key {list(path)} with another type", _encode(tree, path).encode()
    choices = [v for t, v in _VALUES_BY_TYPE.items() if t is not _type(parent[key])]
    parent[key] = rng.choice(choices)
    return f"retyped {list(path)} to {json.dumps(parent[key])}", json.dumps(tree).encode()
