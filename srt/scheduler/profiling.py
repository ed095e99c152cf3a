"""torch.profiler over scheduler steps: SGLang's ``/start_profile`` and ``/stop_profile``.

``start`` opens a profile (CPU activity, plus CUDA on a GPU when ``activities`` asks for
``"GPU"``, the default there; ``"MEM"`` records allocations); every scheduler step calls
:meth:`StepProfiler.step`; the profile ends at ``stop`` or after ``num_steps`` steps (at most
:data:`MAX_PROFILE_STEPS`: an unbounded trace would grow without limit) and is written as a
Chrome trace, ``{output_dir}/{prefix-}{profile_id}-TP-{rank}.trace.json.gz``, which Perfetto and
``chrome://tracing`` open. ``start_step`` waits that many steps before recording. With tensor
parallelism only rank 0 (the scheduler that reads requests) records.

The profile is a side job of the step: :meth:`StepProfiler.step` never raises. A trace that
cannot be written when the profile ends by itself (an unwritable folder, a full disk) is logged
and reported by the next ``/stop_profile``; the requests of that step never see it. The default
folder is ``config.torch_profiler_dir`` (the HTTP routes keep a client's ``output_dir`` inside
it: srt/server/http/paths.py).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixlm.srt.messages import StartProfileReq

logger = logging.getLogger(__name__)

MAX_PROFILE_STEPS = 10_000
MAX_NAME_CHARS = 128  # profile_id and profile_prefix: parts of one file name (255 bytes at most)
ACTIVITIES = ("CPU", "GPU", "MEM")
# ProfileReq fields accepted only at their off values (what this profiler does not do)
OFF_ONLY = {
    "profile_by_stage": (None, False),
    "merge_profiles": (None, False),
    "profile_stages": (None,),
    "detailed_annotations": (None, False),
}


@dataclass
class ProfileArgs:
    output_dir: str
    profile_id: str
    prefix: str
    num_steps: int
    start_step: int
    activities: tuple[str, ...]
    with_stack: bool
    record_shapes: bool

    @classmethod
    def parse(cls, req: StartProfileReq, on_gpu: bool, default_dir: str) -> ProfileArgs:
        """The request's ProfileReq fields, checked; ValueError (its first word the field)."""
        for name, off in OFF_ONLY.items():
            if getattr(req, name) not in off:
                raise ValueError(f"{name} is not supported by this profiler; leave it out")
        num_steps = req.num_steps
        if num_steps is not None and (type(num_steps) is not int or num_steps < 1):
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        start_step = req.start_step or 0
        if type(start_step) is not int or not 0 <= start_step <= MAX_PROFILE_STEPS:
            raise ValueError(f"start_step must be in [0, {MAX_PROFILE_STEPS}], got {start_step!r}")
        activities = req.activities or (["CPU", "GPU"] if on_gpu else ["CPU"])
        if not isinstance(activities, list) or not all(a in ACTIVITIES for a in activities):
            raise ValueError(f"activities must be a list of {', '.join(ACTIVITIES)}")
        if "GPU" in activities and not on_gpu:
            raise ValueError("activities: GPU asked for, but this server runs on the CPU")
        for name in ("output_dir", "profile_id", "profile_prefix"):
            value = getattr(req, name)
            if value is not None and (not isinstance(value, str) or not value or "\0" in value):
                raise ValueError(f"{name} must be a non-empty string")
        for name in ("profile_id", "profile_prefix"):
            value = getattr(req, name) or ""
            if "/" in value or os.sep in value or value in (".", ".."):
                raise ValueError(f"{name} is part of a file name and may not hold '/'")
            if len(value) > MAX_NAME_CHARS:
                raise ValueError(
                    f"{name} is part of a file name: at most {MAX_NAME_CHARS} characters, "
                    f"got {len(value)}"
                )
        return cls(
            output_dir=req.output_dir or default_dir,
            profile_id=req.profile_id or str(int(time.time())),
            prefix=req.profile_prefix or "",
            num_steps=min(num_steps or MAX_PROFILE_STEPS, MAX_PROFILE_STEPS),
            start_step=start_step,
            activities=tuple(activities),
            with_stack=bool(req.with_stack),
            record_shapes=bool(req.record_shapes),
        )

    @property
    def path(self) -> Path:
        name = f"{self.prefix + '-' if self.prefix else ''}{self.profile_id}-TP-0.trace.json.gz"
        return Path(self.output_dir) / name


class StepProfiler:
    def __init__(self, on_gpu: bool, default_dir: str) -> None:
        self.on_gpu = on_gpu
        self.default_dir = default_dir
        self.args: ProfileArgs | None = None
        self.last_error: str | None = None  # a profile that ended by itself unwritten
        self._prof: torch.profiler.profile | None = None
        self._wait = 0  # steps before recording starts
        self._steps = 0  # steps recorded
        self.last_path: str | None = None

    @property
    def is_active(self) -> bool:
        return self.args is not None

    def start(self, req: StartProfileReq) -> dict[str, Any]:
        if self.args is not None:
            raise ValueError("profile is already running; stop it first (/stop_profile)")
        args = ProfileArgs.parse(req, self.on_gpu, self.default_dir)
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        self.args, self._wait, self._steps = args, args.start_step, 0
        self.last_error = None
        if self._wait == 0:
            self._open()
        return {"message": f"profiling; the trace goes to {args.path}", "path": str(args.path)}

    def _open(self) -> None:
        assert self.args is not None
        kinds = [torch.profiler.ProfilerActivity.CPU]
        if "GPU" in self.args.activities:
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=kinds,
            record_shapes=self.args.record_shapes,
            with_stack=self.args.with_stack,
            profile_memory="MEM" in self.args.activities,
        )
        self._prof.start()

    def step(self) -> None:
        """After each scheduler step: counts it, and ends the profile after ``num_steps``.
        Never raises: a failure ends the profile and is kept for ``/stop_profile``."""
        if self.args is None:
            return
        try:
            self._count_step()
        except Exception as e:  # a side job: the step's requests must not fail with it
            logger.exception("the profile failed and was ended")
            self.last_error = f"the profile failed and was ended: {e}"
            self.args, self._prof = None, None

    def _count_step(self) -> None:
        assert self.args is not None
        if self._prof is None:
            self._wait -= 1
            if self._wait <= 0:
                self._open()
            return
        self._prof.step()
        self._steps += 1
        if self._steps >= self.args.num_steps:
            self.stop()

    def stop(self) -> dict[str, Any]:
        """Ends the profile and writes its trace; ValueError when none runs."""
        args, prof = self.args, self._prof
        if args is None:
            error, self.last_error = self.last_error, None
            if error is not None:
                raise ValueError(error)
            raise ValueError("no profile is running; start one with /start_profile")
        self.args, self._prof = None, None
        if prof is None:  # stopped before start_step was reached: nothing recorded
            return {"message": "profile stopped before it started recording", "path": None}
        prof.stop()
        try:
            prof.export_chrome_trace(str(args.path))
        except Exception as e:  # torch raises RuntimeError for an unwritable file
            raise ValueError(f"the trace could not be written to {args.path}: {e}") from e
        self.last_path = str(args.path)
        logger.info("profile of %d step(s) written to %s", self._steps, args.path)
        return {"message": f"profile written to {args.path}", "path": str(args.path)}
