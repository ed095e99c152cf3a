"""Few-shot multiple-choice question answering with ``select``.

Every question shares the same five worked examples; the answer is the option the model finds
most likely (mean token logprob), so it is always one of the options. The shared prefix is
prefilled once and reused from the radix cache by every question and every option.

    python examples/few_shot_qa.py                  # the default model in this process
    python examples/few_shot_qa.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import time

from _backend import connect, example_parser, print_usage

import radixlm.lang as rl

SHOTS = [
    ("Which planet is known as the Red Planet?", ["Venus", "Mars", "Jupiter", "Saturn"], "Mars"),
    ("What is the largest ocean on Earth?", ["Atlantic", "Indian", "Arctic", "Pacific"], "Pacific"),
    ("How many legs does a spider have?", ["Six", "Eight", "Ten", "Four"], "Eight"),
    (
        "What gas do plants absorb from the air?",
        ["Oxygen", "Helium", "Carbon dioxide", "Nitrogen"],
        "Carbon dioxide",
    ),
    (
        "Which animal is known as the king of the jungle?",
        ["Elephant", "Tiger", "Lion", "Zebra"],
        "Lion",
    ),
]
QUESTIONS = [
    ("What is the capital of France?", ["Berlin", "Madrid", "Paris", "Rome"], "Paris"),
    ("What is frozen water called?", ["Steam", "Ice", "Sand", "Glass"], "Ice"),
    ("Which star is closest to the Earth?", ["The Sun", "Sirius", "Polaris", "Vega"], "The Sun"),
    ("How many days are in a week?", ["Five", "Seven", "Ten", "Twelve"], "Seven"),
    ("What color is a clear daytime sky?", ["Green", "Red", "Blue", "Purple"], "Blue"),
    ("Which organ pumps blood through the body?", ["Liver", "Lungs", "Brain", "Heart"], "Heart"),
]


def format_question(question: str) -> str:
    return f"Q: {question}\nA:"


# Cloze style: the options are not listed, each one is scored as the continuation of "A:".
FEW_SHOT_PREFIX = "".join(f"{format_question(q)} {answer}\n\n" for q, _, answer in SHOTS)


@rl.function
def few_shot_qa(s, question: str, options: list[str]):
    s += FEW_SHOT_PREFIX
    s += format_question(question)
    s += rl.select("answer", choices=[" " + o for o in options])


def main() -> None:
    args = example_parser(__doc__).parse_args()
    with connect(args) as backend:
        rl.set_default_backend(backend)
        start = time.perf_counter()
        states = few_shot_qa.run_batch([{"question": q, "options": o} for q, o, _ in QUESTIONS])
        elapsed = time.perf_counter() - start
        correct = 0
        for (question, _, truth), state in zip(QUESTIONS, states, strict=True):
            answer = state["answer"].strip()
            correct += answer == truth
            print(f"{question:45s} -> {answer:10s} ({'right' if answer == truth else 'wrong'})")
        print(f"\naccuracy {correct}/{len(QUESTIONS)} in {elapsed:.1f}s")
        print_usage(backend)


if __name__ == "__main__":
    main()
