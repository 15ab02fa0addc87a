"""Plan YAML: a bounded ``SafeLoader`` and the plan's dumper.

Reading: :class:`PlanLoader` is PyYAML's ``SafeLoader`` (no Python tags; libyaml's parser
when PyYAML has it, :class:`PyPlanLoader` otherwise) that also refuses,
while it composes the document and before anything is built from it:

- documents with more than :data:`MAX_NODES` nodes, counting every alias as the size of the
  node it repeats (so a 1 KB "billion laughs" alias bomb fails at once instead of being
  walked for minutes); anchors and aliases stay allowed for hand-written plans;
- aliases to a node that contains them (recursive structures);
- nesting deeper than :data:`MAX_DEPTH` levels, aliases included (no ``RecursionError``);
- integer literals longer than :data:`MAX_INT_CHARS` characters (Python's int digit limit,
  and numbers like ``10**400`` that overflow every float check);
- scalars whose explicit tag cannot read them (``!!int abc``, ``!!timestamp 2001-02-30``);
- a key written twice in one mapping (PyYAML keeps the last silently; a hand edit that adds a
  second ``bits:`` or ``group_size:`` would otherwise drop the first without a word). Keys a
  ``<<`` merge brings in may still be overridden, as YAML intends.

All of these, and every other YAML error, become ``PlanError("<yaml>", ...)`` naming the
line and column.
"""

from __future__ import annotations

import yaml
from yaml.composer import Composer, ComposerError
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.parser import Parser
from yaml.reader import Reader, ReaderError
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from ..errors import PlanError
from ._checks import MAX_DEPTH

MAX_NODES = 2 ** 16  # a flat (one rule per slot) plan of a 126-layer, 8-KV-head, 2-modality model has ~56k
MAX_INT_CHARS = 40  # 2**128 has 39 digits


def _refuse_repeated_keys(node: yaml.MappingNode) -> None:
    """A scalar key written twice in one mapping, as composed (before any ``<<`` merge is applied)."""
    first = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        seen = first.setdefault((key.tag, key.value), key.start_mark)
        if seen is not key.start_mark:
            raise ComposerError(None, None, f"key {key.value[:40]!r} appears twice in one mapping (first at line "
                                f"{seen.line + 1})", key.start_mark)


class _Bounded:
    """The limits (see module doc), mixed in before PyYAML's ``Composer`` and
    ``SafeConstructor`` in the loaders below."""

    def _start_bounds(self) -> None:
        self._n_nodes = 0
        self._open = [0]  # per open node: the height of its tallest finished child
        self._anchored: dict[str, tuple[int, int]] = {}  # anchor -> (expanded size, height)

    def _count(self, n: int, mark) -> None:
        self._n_nodes += n
        if self._n_nodes > MAX_NODES:
            raise ComposerError(None, None, f"document has more than {MAX_NODES} nodes (aliases counted as the "
                                "nodes they repeat)", mark)

    def _reach(self, height: int, mark) -> None:
        if len(self._open) - 1 + height > MAX_DEPTH:
            raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
        self._open[-1] = max(self._open[-1], height)

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self.anchors:  # an unknown anchor is PyYAML's own error
                if event.anchor not in self._anchored:
                    raise ComposerError(None, None, f"alias *{event.anchor} is recursive (used inside the node "
                                        "it names)", event.start_mark)
                size, height = self._anchored[event.anchor]
                self._reach(height, event.start_mark)
                self._count(size, event.start_mark)
            return super().compose_node(parent, index)
        self._reach(1, event.start_mark)
        before = self._n_nodes
        self._open.append(0)
        node = super().compose_node(parent, index)
        if isinstance(node, yaml.MappingNode):
            _refuse_repeated_keys(node)
        height = self._open.pop() + 1
        self._open[-1] = max(self._open[-1], height)
        self._count(1, event.start_mark)
        if event.anchor is not None:
            self._anchored[event.anchor] = (self._n_nodes - before, height)
        return node

    def construct_object(self, node, deep=False):
        if not isinstance(node, yaml.ScalarNode):
            return super().construct_object(node, deep)
        try:
            return super().construct_object(node, deep)
        except (ValueError, KeyError, AttributeError, OverflowError):  # SafeConstructor on a mistagged scalar
            raise ConstructorError(None, None, f"cannot read {node.value[:40]!r} as {node.tag}",
                                   node.start_mark) from None

    def construct_yaml_int(self, node):
        if len(node.value) > MAX_INT_CHARS:
            raise ConstructorError(None, None, f"integer of {len(node.value)} characters is too large (at most "
                                   f"{MAX_INT_CHARS})", node.start_mark)
        return super().construct_yaml_int(node)


class PyPlanLoader(_Bounded, Reader, Scanner, Parser, Composer, SafeConstructor, Resolver):
    """The bounded loader on PyYAML's pure-Python scanner and parser."""

    def __init__(self, stream):
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self._start_bounds()


PyPlanLoader.add_constructor("tag:yaml.org,2002:int", _Bounded.construct_yaml_int)

if yaml.__with_libyaml__:
    from yaml._yaml import CParser

    class PlanLoader(_Bounded, Composer, CParser, SafeConstructor, Resolver):
        """The bounded loader on libyaml's scanner and parser (about 10x faster on long
        scalars such as a key basis); the composer, and so every limit, stays in Python."""

        def __init__(self, stream):
            CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)
            self._start_bounds()

    PlanLoader.add_constructor("tag:yaml.org,2002:int", _Bounded.construct_yaml_int)
else:
    PlanLoader = PyPlanLoader


def parse_plan_yaml(text: str, source: str | None):
    """The document in ``text`` (plain Python data), or :class:`PlanError` ``<yaml>``."""
    try:
        return yaml.load(text, Loader=PlanLoader)
    except ReaderError as e:  # e.character is the code point (an int) for text input
        code = e.character if isinstance(e.character, int) else ord(e.character)
        raise PlanError("<yaml>", f"character #x{code:04x} at position {e.position} is not allowed in YAML",
                        show_value=False, source=source) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = ", ".join(p for p in (e.context, e.problem) if p)
        raise PlanError("<yaml>", f"not valid YAML at {where}: {problem}", show_value=False, source=source) from None


class FlowMap(dict):
    """A mapping written on one line (bit rules)."""


class PlanDumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
    """Block style for sections, flow style for bit rules and lists of scalars; never anchors.
    libyaml's emitter when PyYAML has it (the same text, ~50x faster on a plan's MB-long base64
    arrays), PyYAML's own otherwise."""

    def ignore_aliases(self, data):
        return True


PlanDumper.add_representer(FlowMap, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v, flow_style=True))
PlanDumper.add_representer(
    list, lambda d, v: d.represent_sequence(
        "tag:yaml.org,2002:seq", v, flow_style=all(not isinstance(x, (dict, list)) for x in v)))


def dump_plan_yaml(d: dict) -> str:
    d["bits"]["rules"] = [FlowMap(r) for r in d["bits"]["rules"]]
    return yaml.dump(d, Dumper=PlanDumper, sort_keys=False, width=120)
