"""``@function`` programs and how they run: ``run``, ``run(stream=True)``, ``run_batch``, ``bind``,
``cache``.

@rl.function
def qa(s, question):
    s += rl.user(question)
    s += rl.assistant(rl.gen("answer", max_tokens=64))

state = qa.run(question="What is the capital of France?", temperature=0)
print(state["answer"])
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixlm.lang.backend_base import BaseBackend, Prompt
from radixlm.lang.errors import ProgramError
from radixlm.lang.interpreter import StreamExecutor
from radixlm.lang.ir import GenParams
from radixlm.lang.prefix_trace import PrefixTracer, constant_prefix
from radixlm.lang.primitives import check_n
from radixlm.lang.state import ProgramState
from radixlm.lang.trace import ProgramTrace, TraceState, trace_program

DEFAULT_MAX_NEW_TOKENS = 128
CACHE_MIN_CHARS = 64  # Program.cache: shorter openings are not prefilled (SGLang's threshold)
_default_backend: BaseBackend | None = None


def set_default_backend(backend: BaseBackend | None) -> None:
    """The backend used by ``run`` and ``run_batch`` when none is passed."""
    global _default_backend
    if backend is not None and not isinstance(backend, BaseBackend):
        raise ValueError(
            f"a backend must be a LocalBackend, RuntimeEndpoint, OpenAI or another "
            f"BaseBackend, got {type(backend).__name__}"
        )
    _default_backend = backend


def get_default_backend() -> BaseBackend | None:
    return _default_backend


def _resolve_backend(backend: BaseBackend | None) -> BaseBackend:
    backend = backend or _default_backend
    if backend is None:
        raise ValueError(
            "no backend: pass backend=... or call rl.set_default_backend("
            "rl.LocalBackend(engine)) / rl.set_default_backend(rl.RuntimeEndpoint(url))"
        )
    return backend


def sampling_defaults(
    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS,
    stop: Any = None,
    stop_token_ids: Any = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    seed: int | None = None,
    stop_regex: Any = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> GenParams:
    """The program-wide sampling parameters every ``gen`` inherits (None: the server's)."""
    return GenParams(
        max_new_tokens=max_new_tokens,
        stop=stop if stop is None or isinstance(stop, str) else tuple(stop),
        stop_token_ids=None if stop_token_ids is None else tuple(stop_token_ids),
        stop_regex=(
            stop_regex if stop_regex is None or isinstance(stop_regex, str) else tuple(stop_regex)
        ),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        seed=seed,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
    )


_SAMPLING_NAMES = tuple(inspect.signature(sampling_defaults).parameters)


class Program:
    """A function ``f(s, *args, **kwargs)`` made runnable. Calling it with a ProgramState as
    the first argument runs it inline inside another program."""

    def __init__(self, func: Callable[..., Any], bound: dict[str, Any] | None = None) -> None:
        if not callable(func):
            raise ValueError(f"@function decorates a function, got {func!r}")
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (
            params[0].POSITIONAL_ONLY,
            params[0].POSITIONAL_OR_KEYWORD,
        ):
            raise ValueError(
                f"program {func.__name__}() must take the state s as its first argument"
            )
        self.func = func
        self.bound = dict(bound or {})
        self._arg_names = {p.name for p in params[1:]}
        self._positional_names = [
            p.name for p in params[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self._takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params)
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Program:
        """A copy with some arguments fixed."""
        self._check_names(kwargs)
        return Program(self.func, {**self.bound, **kwargs})

    def cache(self, backend: BaseBackend | None = None) -> None:
        """SGLang's: prefills the program's constant opening text (what it appends before
        anything that depends on an argument, a generation or a role) on ``backend`` (default:
        the default backend), so that its runs share that prefix from the cache. Openings of
        up to 64 characters are not worth a request and are skipped, as in SGLang."""
        prefix = constant_prefix(self.func, self._traced_names(), self.bound)
        if len(prefix) > CACHE_MIN_CHARS:
            _resolve_backend(backend).cache_prefix(Prompt(text=prefix))

    def trace(self, *, backend: BaseBackend | None = None, **kwargs: Any) -> ProgramTrace:
        """SGLang's: runs the body on a recording state and returns what it appends
        (:class:`radixlm.lang.trace.ProgramTrace`: ``nodes``, ``variables``, ``forks``,
        ``last_node``, ``complete``). Arguments not given stand as ``Argument`` nodes; nothing
        is sent to ``backend`` or any other backend (it is accepted for SGLang's signature)."""
        del backend
        self._check_names(kwargs)
        return trace_program(self.func, self._traced_names(), {**self.bound, **kwargs})

    def _check_names(self, kwargs: dict[str, Any]) -> None:
        unknown = sorted(set(kwargs) - self._arg_names)
        if unknown and not self._takes_kwargs:
            raise ValueError(
                f"{self.__name__}() has no argument(s) {unknown}; it takes "
                f"{sorted(self._arg_names)}"
            )

    def _traced_names(self) -> list[str]:
        """The argument names, positional ones first, for the placeholder traces."""
        names = [n for n in self._positional_names if n in self._arg_names]
        return names + sorted(self._arg_names - set(names))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # called inside another program (running, or traced by trace / cache)
        if args and isinstance(args[0], (ProgramState, TraceState, PrefixTracer)):
            return self.func(*args, **{**self.bound, **kwargs})
        return self.run(*args, **kwargs)

    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        # a program argument that shares a sampling option's name stays the program's
        sampling = {
            k: kwargs.pop(k)
            for k in list(kwargs)
            if k in _SAMPLING_NAMES and k not in self._arg_names
        }
        return sampling, {**self.bound, **kwargs}

    def run(
        self,
        *args: Any,
        backend: BaseBackend | None = None,
        stream: bool = False,
        n: int = 1,
        use_thread: bool = True,
        **kwargs: Any,
    ) -> ProgramState:
        """Run once. Keyword arguments are the program's, plus the sampling defaults
        (max_new_tokens, stop, temperature, top_p, top_k, min_p, ...). Without ``stream`` it
        returns once the program finished (raising its error); with ``stream=True`` at once:
        read the text as it comes with ``state.text_iter()``. SGLang's ``n`` must be 1 (use
        ``s.fork``); ``use_thread`` is accepted: the state always runs on its own thread."""
        check_n(f"{self.__name__}.run()", n)
        sampling, program_kwargs = self._split(dict(kwargs))
        backend = _resolve_backend(backend)
        executor = StreamExecutor(backend, sampling_defaults(**sampling), stream)
        state = ProgramState(executor)
        if stream:
            threading.Thread(
                target=self._execute,
                args=(state, args, program_kwargs),
                name=f"radixlm-{self.__name__}",
                daemon=True,
            ).start()
            return state
        error = self._execute(state, args, program_kwargs)
        if error is not None:
            raise error
        state.sync()
        return state

    def _execute(
        self, state: ProgramState, args: tuple, kwargs: dict[str, Any]
    ) -> Exception | None:
        """Runs the body and ends the state. An exception from the body is stored in the state
        (as a ProgramError) and returned."""
        executor = state._ex
        try:
            self.func(state, *args, **kwargs)
            return None
        except Exception as e:
            err = (
                e
                if isinstance(e, ProgramError)
                else ProgramError(self.__name__, None, f"{type(e).__name__}: {e}")
            )
            if err is not e:
                err.__cause__ = e
            executor.fail(err)
            return e
        finally:
            executor.end()

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: BaseBackend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        n: int = 1,
        generator_style: bool = False,
        **sampling: Any,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run once per dict of arguments (or tuple of positional ones), ``num_threads`` at a
        time; the states come back in the order of ``batch_kwargs`` (as a list, or with
        ``generator_style`` one by one as they finish in that order). A failed program's state
        holds its error (``state.error()``; reading it raises)."""
        check_n(f"{self.__name__}.run_batch()", n)
        batch_kwargs = [self._as_kwargs(kw) for kw in batch_kwargs]
        unknown = sorted(set(sampling) - set(_SAMPLING_NAMES))
        if unknown:
            raise ValueError(
                f"run_batch() got unknown option(s) {unknown}; program arguments go "
                f"in batch_kwargs, options are {list(_SAMPLING_NAMES)}"
            )
        if not all(isinstance(kw, dict) for kw in batch_kwargs):
            raise ValueError(
                "batch_kwargs must be a list of dicts (or tuples) of program arguments"
            )
        if not batch_kwargs:
            return []
        backend = _resolve_backend(backend)
        defaults = sampling_defaults(**sampling)
        workers = _num_threads(num_threads, len(batch_kwargs))

        def one(kw: dict[str, Any]) -> ProgramState:
            state = ProgramState(StreamExecutor(backend, defaults))
            self._execute(state, (), {**self.bound, **kw})
            return state

        def states() -> Iterator[ProgramState]:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                results = pool.map(one, batch_kwargs)
                if progress_bar:
                    from tqdm import tqdm

                    results = tqdm(results, total=len(batch_kwargs), desc=self.__name__)
                yield from results

        return states() if generator_style else list(states())

    def _as_kwargs(self, args: Any) -> Any:
        """SGLang also takes a batch entry as the program's positional arguments."""
        if not isinstance(args, (list, tuple)):
            return args
        names = self._positional_names
        if len(args) > len(names):
            raise ValueError(
                f"{self.__name__}() takes {len(names)} positional argument(s) after s, a batch "
                f"entry gave {len(args)}: {list(args)!r}"
            )
        return dict(zip(names, args, strict=False))  # fewer: the rest keep their defaults


def _num_threads(num_threads: int | str, batch_size: int) -> int:
    if num_threads == "auto":
        return max(1, min(batch_size, max(64, 16 * (os.cpu_count() or 1))))
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be 'auto' or an integer >= 1, got {num_threads!r}")
    return num_threads


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator: ``@function`` (or ``@function()``) turns ``f(s, ...)`` into a Program.
    SGLang's ``num_api_spec_tokens`` (speculative calls to a chat API) is not supported."""
    if num_api_spec_tokens is not None:
        raise ValueError("function(num_api_spec_tokens=...) is not supported; leave it out")
    if func is None:
        return Program
    return Program(func)
