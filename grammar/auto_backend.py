"""``auto``: the grammar backend that picks outlines-core or llguidance per spec.

It compiles regexes, choices and JSON schemas with outlines-core, falling back to
llguidance when outlines-core rejects the spec, when the spec's regex is too long for a DFA
(``outlines_max_regex_chars``) or when it does not finish within ``outlines_budget_s`` (it runs
in a child process, killed when over budget; see ``outlines_worker``). llguidance compiles in tens
of milliseconds, so the whole attempt stays within about 5 s. EBNF grammars, ``json_object``
and structural tags go straight to llguidance (the generic-JSON DFA is slow to build;
outlines-core has no context-free grammars). JSON schemas with numeric bounds or ``allOf``
(which outlines-core accepts but may ignore) try llguidance first. A JSON schema neither
backend accepts gets a last try on llguidance in lenient mode, which ignores the keywords it
does not implement (so does a structural tag llguidance rejects, for its tags' schemas). When
every other backend rejects a spec whose outlines-core build went over budget, ``auto`` waits
for that build after all (at most ``outlines_last_resort_s`` more): a schema only outlines-core
accepts, just over the budget on a loaded CPU, still compiles. A schema llguidance calls
invalid or unsatisfiable fails at once (outlines-core would ignore the keyword at fault). Under
contention (``CompileControl.should_yield``) outlines-core is skipped or its build killed; a
spec nothing else compiles is deferred to the compile cache's slow lane.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

from radixlm.grammar.base import (
    CompileControl,
    CompileDeferred,
    CompiledGrammar,
    GrammarBackend,
    GrammarCompileError,
    GrammarSpec,
)
from radixlm.grammar.llguidance_backend import (
    GrammarTooComplexError,
    InvalidSchemaError,
    LLGuidanceBackend,
)
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.outlines_worker import DEFAULT_MAX_MEMORY_BYTES, IndexJob, IndexWorkerPool
from radixlm.grammar.schema_checks import (
    check_compilable,
    outlines_regex_lower_bound,
    recursive_ref,
    schema_nodes,
)

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a wait on an outlines-core build asks the cache's control
_LLGUIDANCE_ONLY_KINDS = ("ebnf", "json_object", "structural_tag")
# JSON Schema keywords outlines-core accepts but does not (always) enforce, while llguidance
# does. outlines-core drops an ``allOf`` next to ``properties`` in the same schema.
_OUTLINES_IGNORED_KEYWORDS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "allOf"}
)


# outlines-core also mistranslates these (its output then fails the schema, or is not JSON):
# a pattern is pasted into the string's regex (an alternation loses its grouping, "." admits a
# raw quote), property names are not escaped, prefixItems drops items/minItems, anyOf/oneOf or
# $ref next to other keywords are dropped, required names outside properties are ignored,
# an empty schema ({}, any value) is pasted in ungrouped (`"k": true|null|...` admits `{7}`),
# date/time formats are checked loosely (no calendar, no offset), and the email, uri and time
# regexes admit a raw quote, backslash or control character inside the JSON string (the output
# is then not JSON: `{"u": "urn:a:b",,x"}`)
# ("not" is rewritten before compiling, to false or a type list outlines-core is slow on)
_OUTLINES_MISREAD_KEYWORDS = frozenset({"pattern", "patternProperties", "prefixItems", "not"})
_OUTLINES_LOOSE_FORMATS = frozenset({"date", "time", "date-time", "email", "uri"})
_REF_SIBLINGS_OK = frozenset(
    {"$defs", "definitions", "title", "description", "$comment", "default", "examples"}
)
_CONTAINER_KEYWORDS = frozenset(
    {"properties", "additionalProperties", "patternProperties", "items", "prefixItems"}
)
_UNESCAPED_NAME = re.compile(r'["\\\x00-\x1f]')


def _uses_keywords_outlines_ignores(schema: Any) -> bool:
    """Whether outlines-core would compile ``schema`` into a grammar that admits documents the
    schema does not (llguidance enforces these): such schemas try llguidance first."""
    return any(_outlines_misreads(node) for node in schema_nodes(schema))


def _outlines_misreads(node: dict) -> bool:
    if _OUTLINES_IGNORED_KEYWORDS.intersection(node) or _OUTLINES_MISREAD_KEYWORDS.intersection(
        node
    ):
        return True
    properties = node.get("properties")
    if isinstance(properties, dict):
        if "anyOf" in node or "oneOf" in node:
            return True
        if any(_UNESCAPED_NAME.search(str(name)) for name in properties):
            return True
        required = node.get("required")
        if isinstance(required, list) and not set(map(str, required)) <= set(properties):
            return True
    if "$ref" in node and set(node) - _REF_SIBLINGS_OK - {"$ref"}:
        return True
    if not set(node) - _REF_SIBLINGS_OK - {"$schema", "$id", "id"}:
        return True  # {} (any value): its alternatives lose their grouping (`{"k": 1}` -> `{1}`)
    types = node.get("type")
    if (
        isinstance(types, list)
        and {"object", "array"} & set(types)
        and not _CONTAINER_KEYWORDS.intersection(node)
    ):
        # any object / array among other types (`not: {"type": "null"}` rewritten):
        # outlines-core unrolls generic JSON to a fixed depth, seconds as for json_object
        return True
    return node.get("format") in _OUTLINES_LOOSE_FORMATS


class AutoGrammarBackend(GrammarBackend):
    """outlines-core first for regular specs, llguidance for the rest and as the fallback."""

    name = "auto"

    def __init__(
        self,
        outlines: OutlinesBackend,
        llguidance: LLGuidanceBackend,
        outlines_budget_s: float = 3.0,
        lenient_llguidance: LLGuidanceBackend | None = None,
        outlines_last_resort_s: float = 20.0,
        outlines_max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
        outlines_yield_after_s: float = 0.5,
    ) -> None:
        self.outlines = outlines
        self.llguidance = llguidance
        self.lenient_llguidance = lenient_llguidance  # JSON schemas both others reject
        self.outlines_budget_s = outlines_budget_s
        self.outlines_last_resort_s = outlines_last_resort_s
        # Under contention a build is killed after this long (the spec moves on).
        self.outlines_yield_after_s = outlines_yield_after_s
        self.index_workers = IndexWorkerPool(
            outlines.outlines_vocabulary, outlines_max_memory_bytes
        )
        self.num_fallbacks = 0
        self._lock = threading.Lock()

    def cache_tag(self) -> str:
        lenient = "+lenient" if self.lenient_llguidance is not None else ""
        # route: revision of the routing rules (which spec goes to which engine first)
        return f"auto[{self.outlines.cache_tag()}+{self.llguidance.cache_tag()}{lenient},route=3]"

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        return self.compile_controlled(spec, CompileControl())

    def compile_controlled(self, spec: GrammarSpec, control: CompileControl) -> CompiledGrammar:
        """Tries the backends in ``_order``. While other specs wait for the worker
        (``control.should_yield``), outlines-core is skipped (or its build killed after
        ``outlines_yield_after_s``); if no other backend compiles the spec, ``CompileDeferred``
        sends it to the cache's slow lane. A cancelled compilation kills its build."""
        errors: list[tuple[GrammarBackend, GrammarCompileError]] = []
        overrun: IndexJob | None = None  # an over-budget outlines-core build, still going
        is_deferred = False
        schema = check_compilable(spec, self.outlines.limits)
        try:
            for backend in self._order(spec, schema):
                if backend is self.lenient_llguidance and (
                    is_deferred or any(isinstance(e, GrammarTooComplexError) for _, e in errors)
                ):
                    continue  # leniency does not make a grammar smaller
                if backend is self.outlines and control.should_yield():
                    is_deferred = True
                    continue
                self._log_fallback(spec, errors, backend)
                try:
                    if backend is self.outlines:
                        return self._reported(
                            spec, backend, self._compile_outlines_within_budget(spec, control)
                        )
                    return self._reported(spec, backend, backend.compile(spec))
                except _OutlinesYielded:
                    is_deferred = True
                except _OutlinesOverrun as error:
                    overrun = error.job
                    errors.append((backend, error))
                except InvalidSchemaError:
                    raise  # the schema is wrong: another backend would only ignore the fault
                except GrammarCompileError as error:
                    errors.append((backend, error))
            if is_deferred:
                raise CompileDeferred(spec.describe())
            if overrun is not None:
                grammar = self._wait_for_overrun(spec, overrun, control)
                if grammar is not None:
                    return self._reported(spec, self.outlines, grammar)
        finally:
            if overrun is not None:
                overrun.cancel()  # kills the child unless the build has finished
        last = errors[-1][1]
        earlier = "; ".join(f"{_label(b)}: {e.reason}" for b, e in errors[:-1])
        reason = f"{last.reason} ({earlier})" if earlier else last.reason
        raise GrammarCompileError(spec.kind, reason) from last

    def _reported(
        self, spec: GrammarSpec, backend: GrammarBackend, grammar: CompiledGrammar
    ) -> CompiledGrammar:
        """``grammar``, its unenforced keywords logged (once per compilation: cached after)."""
        if grammar.unenforced:
            logger.info(
                "%s compiled by %s; not enforced: %s",
                spec.describe(),
                _label(backend),
                ", ".join(grammar.unenforced),
            )
        return grammar

    def _log_fallback(self, spec: GrammarSpec, errors: list, backend: GrammarBackend) -> None:
        if not errors:
            return
        with self._lock:
            self.num_fallbacks += 1
        logger.info(
            "%s failed on %s (%s); trying %s",
            _label(errors[-1][0]),
            spec.describe(),
            errors[-1][1].reason,
            _label(backend),
        )

    def _order(self, spec: GrammarSpec, schema: Any = None) -> list[GrammarBackend]:
        lenient = [] if self.lenient_llguidance is None else [self.lenient_llguidance]
        if spec.kind == "structural_tag":  # its tags' JSON schemas get the lenient last try
            return [self.llguidance, *lenient]
        if spec.kind in _LLGUIDANCE_ONLY_KINDS:
            return [self.llguidance]
        # outlines-core unrolls recursion to a fixed depth (a dead end deep in a document).
        llguidance_first = schema is not None and (
            _uses_keywords_outlines_ignores(schema) or recursive_ref(schema) is not None
        )
        if llguidance_first and spec.kind == "json_schema":
            # lenient llguidance (keeps the bounds it can) before outlines-core (drops them)
            order: list[GrammarBackend] = [self.llguidance, *lenient, self.outlines]
            lenient = []
        elif llguidance_first:
            order = [self.llguidance, self.outlines]
        else:
            order = [self.outlines, self.llguidance]
        limit = self.outlines.max_regex_chars
        if schema is not None and limit and outlines_regex_lower_bound(schema) > limit:
            order.remove(self.outlines)  # its regex would be rejected as too long anyway
        if spec.kind == "json_schema":
            order.extend(lenient)
        return order

    def deserialize(self, spec: GrammarSpec, backend_name: str, data: bytes) -> CompiledGrammar:
        # A lenient llguidance grammar's text carries its options: any llguidance backend loads it.
        backend = self.outlines if backend_name == self.outlines.name else self.llguidance
        return backend.deserialize(spec, backend_name, data)

    def _compile_outlines_within_budget(
        self, spec: GrammarSpec, control: CompileControl
    ) -> CompiledGrammar:
        began = time.monotonic()
        job = self.outlines.start_build(self.index_workers, spec)
        try:
            index = self._wait_polling(spec, job, began + self.outlines_budget_s, control, began)
        except BaseException:
            job.cancel()
            raise
        if index is None:
            raise _OutlinesOverrun(
                spec.kind, f"outlines-core did not finish within {self.outlines_budget_s:g} s", job
            )
        return self.outlines.grammar_from_index(spec, index, job.num_message_bytes)

    def _wait_polling(
        self,
        spec: GrammarSpec,
        job: IndexJob,
        deadline: float,
        control: CompileControl,
        yield_from: float | None = None,
    ):
        """``job``'s index, or None at ``deadline``; asks ``control`` every ``_POLL_S``:
        raises ``GrammarCompileError`` when cancelled and ``_OutlinesYielded`` when asked to
        yield (after ``outlines_yield_after_s`` past ``yield_from``; never if None)."""
        while True:
            now = time.monotonic()
            if control.is_cancelled():
                raise GrammarCompileError(spec.kind, "the compilation was cancelled")
            if (
                yield_from is not None
                and now - yield_from >= self.outlines_yield_after_s
                and control.should_yield()
            ):
                raise _OutlinesYielded(spec.kind, "outlines-core gave way to waiting specs")
            if now >= deadline:
                return None
            index = job.wait(min(_POLL_S, deadline - now))
            if index is not None:
                return index

    def _wait_for_overrun(
        self, spec: GrammarSpec, job: IndexJob, control: CompileControl
    ) -> CompiledGrammar | None:
        """The over-budget outlines-core build's grammar if it finishes within the last-resort
        wait, else None."""
        if self.outlines_last_resort_s <= 0:
            return None
        logger.info(
            "no other backend compiles %s; waiting up to %g s more for outlines-core",
            spec.describe(),
            self.outlines_last_resort_s,
        )
        try:
            deadline = time.monotonic() + self.outlines_last_resort_s
            index = self._wait_polling(spec, job, deadline, control)
        except GrammarCompileError:
            return None
        if index is None:
            return None
        logger.info("outlines-core compiled %s past its budget", spec.describe())
        return self.outlines.grammar_from_index(spec, index, job.num_message_bytes)

    def shutdown(self) -> None:
        self.index_workers.close()


class _OutlinesYielded(GrammarCompileError):
    """outlines-core gave its worker up to waiting specs; its build was killed."""


class _OutlinesOverrun(GrammarCompileError):
    """outlines-core went past its budget; its build goes on in ``job`` until cancelled."""

    def __init__(self, kind: str, reason: str, job: IndexJob) -> None:
        super().__init__(kind, reason)
        self.job = job


def _label(backend: GrammarBackend) -> str:
    return f"{backend.name} (lenient)" if getattr(backend, "lenient", False) else backend.name
