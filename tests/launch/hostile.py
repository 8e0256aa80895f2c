"""Hostile values for launcher tests: each would run a command, become an option, a comment, a second
host or a second word somewhere between the topology file and a node, if any layer let it through.
``{mark}`` is a file path that exists only if something ran."""

HOSTILE = {
    "semicolon": "a0;touch {mark};",
    "command substitution": "a$(touch {mark})",
    "backticks": "a`touch {mark}`",
    "newline": "a0\ntouch {mark}",
    "leading dash": "-oProxyCommand=touch {mark}",
    "hash": "#a0",
    "comma": "a0,evil",
    "space": "a0 touch {mark}",
    "single quote": "a0'x",
    "double quote": 'a0"x',
    "non-ASCII": "a\u00e40",
    "dollar variable": "a$HOME",
}


def hostile(kind: str, mark) -> str:
    return HOSTILE[kind].format(mark=mark)
