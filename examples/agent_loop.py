"""A multi-turn agent loop that calls a small local Python tool (a calculator).

Each assistant turn first picks an action with ``select`` (CALC or ANSWER), then writes its
argument with ``gen``. CALC runs the calculator here in Python and sends the result back as the
next user message; the conversation grows turn by turn and every turn reuses the cached prefix.

    python examples/agent_loop.py
    python examples/agent_loop.py --task "..." --max-turns 6
"""

from __future__ import annotations

import ast
import operator

from _backend import connect, example_parser, print_usage

import radixlm.lang as rl

SYSTEM = (
    "You solve arithmetic tasks with a calculator. Each reply is one line: either "
    "CALC: <expression> to use the calculator, or ANSWER: <number> when you are done."
)
EXAMPLE_TURNS = [
    ("user", "Apples cost 2 dollars each. How much do 5 apples cost?"),
    ("assistant", "CALC: 5 * 2"),
    ("user", "Calculator result: 10"),
    ("assistant", "ANSWER: 10"),
]
EXPRESSION_REGEX = r"[0-9]{1,6} [-+*/] [0-9]{1,6}"  # one operation per call
NUMBER_REGEX = r"-?[0-9]{1,12}(\.[0-9]{1,4})?"
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """Evaluates + - * / and parentheses on numbers, nothing else."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers, + - * / and parentheses are allowed")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


@rl.function
def agent(s, task: str, max_turns: int = 4):
    s += rl.system(SYSTEM)
    for role, content in EXAMPLE_TURNS:  # one worked exchange shows the protocol
        s += rl.user(content) if role == "user" else rl.assistant(content)
    s += rl.user(task)
    for _ in range(max_turns):
        with s.assistant():
            s += rl.select("action", ["CALC", "ANSWER"]) + ": "
            if s["action"] == "CALC":
                s += rl.gen("argument", max_tokens=24, stop="\n", regex=EXPRESSION_REGEX)
            else:
                s += rl.gen("argument", max_tokens=16, stop="\n", regex=NUMBER_REGEX)
        if s["action"] == "ANSWER":
            s["answer"] = s["argument"].strip()
            return
        result = calculator(s["argument"].split("=")[0])  # "3 * 4 = 12" -> "3 * 4"
        s["tool_calls"] = s["tool_calls"] + 1 if "tool_calls" in s else 1
        s += rl.user(f"Calculator result: {result}")
    s["answer"] = None  # no answer within max_turns


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument(
        "--task", default="A shop sells pens at 3 dollars each. How much do 14 pens cost?"
    )
    parser.add_argument("--max-turns", type=int, default=4)
    args = parser.parse_args()
    with connect(args) as backend:
        state = agent.run(task=args.task, max_turns=args.max_turns, backend=backend, temperature=0)
        for m in state.messages():
            print(f"[{m['role']}] {m['content']}")
        print(f"\nfinal answer: {state['answer']}")
        print_usage(backend)


if __name__ == "__main__":
    main()
