"""Skeleton-of-thought with ``fork``: outline first, then expand every point in parallel.

The outline is generated once; ``s.fork(n)`` prefills it (so every branch reuses its cache)
and each branch expands one point; ``join`` gathers the expansions, which are then summed up.
With ``--depth 2`` each expansion forks again into two alternatives (a small tree of thought).

    python examples/skeleton_of_thought.py
    python examples/skeleton_of_thought.py --question "How can I sleep better?" --depth 2
"""

from __future__ import annotations

import time

from _backend import connect, example_parser, print_usage

import radixlm.lang as rl


@rl.function
def skeleton_of_thought(s, question: str, num_points: int = 3, depth: int = 1):
    s += rl.user(f"{question} Give {num_points} short points, one per line.")
    with s.assistant():
        for i in range(num_points):
            s += f"{i + 1}." + rl.gen(f"point_{i}", max_tokens=24, stop="\n") + "\n"
    forks = s.fork(num_points)
    for i, f in enumerate(forks):
        f += rl.user(f"Explain point {i + 1} in one sentence.")
        f += rl.assistant(rl.gen("expansion", max_tokens=40))
    if depth > 1:  # a second level: every expansion branches into two alternative follow-ups
        groups = [f.fork(2) for f in forks]
        for group in groups:
            for j, alt in enumerate(group):
                alt += rl.user(f"Give a different example for this point (example {j + 1}).")
                alt += rl.assistant(rl.gen("alternative", max_tokens=32, temperature=0.8, seed=j))
        for group in groups:
            group.join()
    forks.join()
    details = "\n".join(f"{i + 1}. {e.strip()}" for i, e in enumerate(s["expansion"]))
    s += rl.user(f"The points in detail:\n{details}\nSum them up in one sentence.")
    s += rl.assistant(rl.gen("summary", max_tokens=48))


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--question", default="What are the benefits of drinking water?")
    parser.add_argument("--points", type=int, default=3)
    parser.add_argument("--depth", type=int, default=1, choices=(1, 2))
    args = parser.parse_args()
    with connect(args) as backend:
        start = time.perf_counter()
        state = skeleton_of_thought.run(
            question=args.question,
            num_points=args.points,
            depth=args.depth,
            backend=backend,
            temperature=0,
        )
        for m in state.messages():
            print(f"[{m['role']}] {m['content']}")
        for i, expansion in enumerate(state["expansion"]):
            print(f"[branch {i + 1}] {expansion}")
        if args.depth > 1:
            print("\nAlternatives per point:", state["alternative"])
        print(f"\n({time.perf_counter() - start:.1f}s)")
        print_usage(backend)


if __name__ == "__main__":
    main()
