"""Label selectors and names checked as the API server checks them (apimachinery's
`labels.Parse` and `validation.IsQualifiedName` / `IsDNS1123Label`), so that a setting the API
server would refuse is named when the component starts, not at the first call that uses it
(for NVIDIA's plugin pods: the first MIG change, maybe days later)."""

from __future__ import annotations

import re

_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_SUBDOMAIN = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*"
_KEY = re.compile(rf"(?:(?P<prefix>{_SUBDOMAIN})/)?{_NAME}")
_VALUE = re.compile(rf"(?:{_NAME})?")
_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
_INT64 = 1 << 63

# apimachinery's lexer: whitespace is ' ', \t, \r and \n only (not Python's \s: a no-break space
# copied from a web page is part of a token there, and refused)
_WS = r"[ \t\r\n]"
_TOKEN = r"[^ \t\r\n!=<>(),]+"
# one requirement: `key`, `!key`, `key=v`, `key==v`, `key!=v`, `key in (v,...)`, `key notin (v,...)`,
# `key>N`, `key<N`; values may be empty where the API server allows it
_REQUIREMENT = re.compile(rf"{_WS}*(?:(?P<not>!){_WS}*(?P<nkey>{_TOKEN})"
                          rf"|(?P<key>{_TOKEN}){_WS}*(?:(?P<op>==|!=|=|<|>){_WS}*(?P<value>[^ \t\r\n!=<>(),]*)"
                          rf"|{_WS}(?P<set>in|notin){_WS}*\((?P<values>[^()]*)\))?){_WS}*")


def dns_label_problem(text: str) -> str | None:
    """What is wrong with a namespace name (an RFC 1123 label), or None."""
    if not _DNS_LABEL.fullmatch(text):
        return (f"{text!r} is not a valid namespace name (lower-case letters, digits and '-', starting and "
                "ending with a letter or digit, at most 63 characters)")
    return None


def dns_subdomain_problem(text: str, what: str = "name") -> str | None:
    """What is wrong with an object's name that must be an RFC 1123 subdomain (a Lease's), or None."""
    if len(text) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in text.split(".")):
        return (f"{text!r} is not a valid {what} (lower-case letters, digits, '-' and '.', starting and ending "
                "with a letter or digit, at most 253 characters)")
    return None


def _key_problem(key: str) -> str | None:
    m = _KEY.fullmatch(key)
    if not m or (m.group("prefix") and len(m.group("prefix")) > 253):
        return f"label key {key!r} is not a qualified name ([prefix/]name, name at most 63 characters)"
    return None


def _value_problem(value: str) -> str | None:
    if not _VALUE.fullmatch(value):
        return f"label value {value!r} is not valid (at most 63 letters, digits, '-', '_' or '.')"
    return None


def selector_problem(text: str) -> str | None:
    """What is wrong with a label selector (the `-l` syntax), or None. An empty selector is a
    problem too: it selects every object."""
    if not text.strip(" \t\r\n"):
        return "an empty label selector selects every pod"
    # split on the commas outside parentheses
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    for part in parts:
        m = _REQUIREMENT.fullmatch(part)
        if m is None:
            return f"{part.strip()!r} is not a label requirement (key, !key, key=value, key!=value, key in (a,b))"
        problem = _key_problem(m.group("nkey") or m.group("key"))
        if problem:
            return problem
        op, values = m.group("op"), m.group("values")
        if op in ("<", ">"):
            # an int64 (ParseInt), and a valid label value too (so not negative)
            value = m.group("value")
            if not re.fullmatch(r"[0-9]+", value) or int(value) >= _INT64:
                return f"{part.strip()!r}: {op} needs a non-negative 64-bit integer"
            problem = _value_problem(value)
        elif op is not None:
            problem = _value_problem(m.group("value"))
        elif values is not None:
            # `()` is the set of the empty value, which the API server takes
            items = [v.strip(" \t\r\n") for v in values.split(",")]
            problem = next(filter(None, map(_value_problem, items)), None)
        if problem:
            return problem
    return None


__all__ = ["dns_label_problem", "selector_problem"]
