"""YAML as dynpart reads it: `yaml.safe_load`, except that a mapping naming a key twice is an error
(PyYAML keeps the last value silently, so a setting given twice in a file, or a catalog entry
pasted twice, would change the result without a word)."""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError


class _UniqueKeyLoader(yaml.SafeLoader):
    pass


def _mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *defaults`: merged values a key of the mapping itself may override
        key = loader.construct_object(key_node, deep=deep)
        try:
            twice = key in seen
        except TypeError:  # an unhashable key: the constructor says so
            break
        if twice:
            raise ConstructorError("while reading a mapping", node.start_mark,
                                   f"key {key_node.value!r} given twice (or a key equal to it: 1 and true are)",
                                   key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load(text: str) -> Any:
    """The document in `text` (None when empty); yaml.YAMLError when it is not valid YAML or a
    mapping names a key twice."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
