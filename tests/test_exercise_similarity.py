"""Nothing to copy: no solution block may be (nearly) printed in a lesson a learner has read by then.

For every ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` block of ``solutions/NN_*.ipynb``,
this compares the block with every code cell of ``notebooks/00_*.ipynb`` through
``notebooks/NN_*.ipynb`` (its own lesson and every earlier one: lesson 00 once showed the grader on a
causal mask one "+ 1" away from exercise 03's answer) and with every text output of those cells
(what ``print(inspect.getsource(...))`` shows lands there), one text at a time, and fails when the
closest one is too similar. Later lessons are not compared (a learner does exercise NN before
reading lesson NN+1, and later lessons may build on earlier answers); ``python
tests/test_exercise_similarity.py`` prints their figures too, for information.

Normalisation (``normalised_tokens``): Python's ``tokenize`` (a regex tokenizer for text it
cannot read, such as an output mixing code and tables); comments, docstrings, newlines and
indentation dropped; every identifier becomes ``ID`` except keywords and attribute names (the
``transpose`` in ``k.transpose``: the API calls are the substance of a transcription, variable
names are not); every string literal becomes ``STR``; numbers and operators stay.

Similarity (``similarity``): the fraction of the solution's tokens that lie in runs of at least
``RUN = 6`` tokens common to the solution and the lesson text, in order (``difflib.SequenceMatcher``
matching blocks, autojunk off). Six normalised tokens are about one short statement
(``ID = ID . transpose ( -``); shorter common runs are what any two pieces of PyTorch share.
Unlike ``SequenceMatcher.ratio``, it does not fall when the lesson text is long (a whole
function printed around the few lines the exercise asks for).

Threshold ``LIMIT = 0.5``, from the figures measured on the lessons as they stood when this test
was written (issue 11; ``python tests/test_exercise_similarity.py`` prints them):

* transcriptions, which must fail: 01.stable_softmax 0.85, 02.split_heads 1.00,
  02.merge_heads 1.00, 03.causal_mask 0.70, 03.padding_mask 0.68, 08.attention_entropy 0.97,
  09.patchify 1.00, 09.add_class_token_and_positions 0.90, 09.vit_attention 0.78,
  11.apply_rotary 0.64: all above 0.64;
* honest teaching cells, which must pass: every other block, 0.13 to 0.46 (the highest,
  07.merge_partials 0.46 and 08.qk_norm_attention 0.44, share single statements with their
  lessons' worked examples), except 04.saved_tensor_bytes at 0.61, whose lesson shows the same
  ``saved_tensors_hooks`` code on a neighbouring function: flagged on purpose, for the lesson's
  author to judge.

0.5 sits between 0.46 and 0.64. Very short blocks (under ``SHORT = 12`` tokens, a one-liner such
as ``return x.tril()``) would match ordinary code by chance once names are normalised; they
fail only when their exact token stream, names kept, appears in a lesson text.

What this cannot see: a lesson that prints the same algorithm in other words. The solution of
01.attention writes ``torch.matmul(q, k.transpose(-2, -1)) * scale`` where lesson 01 defines
``attention`` with ``q @ k.transpose(-2, -1) / math.sqrt(d_k)`` (0.33); 11.repeat_kv's solution
expands where the lesson prints ``repeat_interleave`` (0.30); 10.conv_module's solution calls
``F.conv1d`` where the lesson prints the module's ``forward`` (0.29). Lessons and solutions are
written together, so keep the solution in the words a learner would copy from the lesson.
"""

from __future__ import annotations

import ast
import difflib
import io
import keyword
import re
import textwrap
import tokenize
from pathlib import Path

import nbformat
import pytest

from attn_course.notebooks import BEGIN, END

ROOT = Path(__file__).resolve().parents[1]
RUN = 6
LIMIT = 0.5
SHORT = 12

_OPERATOR = re.compile(r"\*\*=?|//=?|->|<<=?|>>=?|:=|\.\.\.|[-+*/%&|^@=!<>]=|\d[\w.]*|\w+|[^\w\s]")
_SKIPPED = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
            tokenize.ENDMARKER)
_STATEMENT_START = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)


def _name(token: str, previous: str | None, keep_names: bool) -> str:
    return token if keep_names or keyword.iskeyword(token) or previous == "." else "ID"


def _python_tokens(text: str, keep_names: bool) -> list[str]:
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type not in
              (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING)]
    out: list[str] = []
    for i, tok in enumerate(tokens):
        if tok.type in _SKIPPED:
            continue
        if tok.type == tokenize.STRING:
            before = tokens[i - 1].type if i else tokenize.NEWLINE
            after = tokens[i + 1].type if i + 1 < len(tokens) else tokenize.NEWLINE
            if before in _STATEMENT_START and after in (tokenize.NEWLINE, tokenize.ENDMARKER):
                continue  # a docstring (a string that is a whole statement)
            out.append("STR")
        elif tok.type == tokenize.NAME:
            out.append(_name(tok.string, tokens[i - 1].string if i else None, keep_names))
        else:
            out.append(tok.string)
    return out


def _regex_tokens(text: str, keep_names: bool) -> list[str]:
    text = re.sub(r'("""|\'\'\')[\s\S]*?\1', " ", text)  # docstrings
    text = re.sub(r"#[^\n]*", " ", text)  # comments
    text = re.sub(r"""[rbfuRBFU]*("[^"\n]*"|'[^'\n]*')""", " STR ", text)
    raw = _OPERATOR.findall(text)
    out = []
    for i, tok in enumerate(raw):
        is_name = tok != "STR" and (tok[0].isalpha() or tok[0] == "_")
        out.append(_name(tok, raw[i - 1] if i else None, keep_names) if is_name else tok)
    return out


def normalised_tokens(text: str, *, keep_names: bool = False) -> list[str]:
    """The token stream compared: names -> ``ID`` (unless ``keep_names``), strings -> ``STR``, no comments."""
    text = textwrap.dedent(text)
    try:
        return _python_tokens(text, keep_names)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return _regex_tokens(text, keep_names)


def similarity(solution: list[str], text: list[str]) -> float:
    """Fraction of ``solution``'s tokens inside runs of at least ``RUN`` tokens shared with ``text``, in order."""
    if not solution or not text:
        return 0.0
    matcher = difflib.SequenceMatcher(None, solution, text, autojunk=False)
    shared = sum(block.size for block in matcher.get_matching_blocks() if block.size >= RUN)
    return shared / len(solution)


def _contains(text: list[str], part: list[str]) -> bool:
    return any(text[i : i + len(part)] == part for i in range(len(text) - len(part) + 1))


def solution_blocks(path: Path) -> list[tuple[str, str]]:
    """``(name, block source)`` for each marked block, named after the function it sits in."""
    found = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code" or BEGIN not in cell.source:
            continue
        lines, current, name = cell.source.splitlines(), None, "?"
        for line in lines:
            match = re.match(r"\s*def (\w+)", line)
            if match and current is None:
                name = match.group(1)
            if BEGIN in line:
                current = []
            elif END in line and current is not None:
                found.append((name, "\n".join(current)))
                current = None
            elif current is not None:
                current.append(line)
    return found


def lesson_texts(path: Path) -> list[tuple[str, str]]:
    """``(where, text)``: each code cell's source, and each of its text outputs."""
    texts = []
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        texts.append((f"code cell {index} (source)", cell.source))
        for output in cell.get("outputs", []):
            stream = output.get("output_type") == "stream"
            text = output.get("text") if stream else output.get("data", {}).get("text/plain")
            if isinstance(text, list):
                text = "".join(text)
            if not text:
                continue
            if text[:1] in "'\"":  # a string's repr, e.g. a bare inspect.getsource(...) as the last line
                try:
                    value = ast.literal_eval(text)
                    text = value if isinstance(value, str) else text
                except (ValueError, SyntaxError):
                    pass
            texts.append((f"code cell {index} (output)", text))
    return texts


def _lesson_for(solution: Path) -> Path:
    (lesson,) = (ROOT / "notebooks").glob(f"{solution.name[:2]}_*.ipynb")
    return lesson


def _lessons_up_to(solution: Path) -> list[Path]:
    """The solution's own lesson and every earlier one (00 included): what a learner has read by then."""
    number = int(solution.name[:2])
    return sorted(p for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb") if int(p.name[:2]) <= number)


def _later_lessons(solution: Path) -> list[Path]:
    number = int(solution.name[:2])
    return sorted(p for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb") if int(p.name[:2]) > number)


def closest(solution: Path, block: str, lessons: list[Path] | None = None) -> tuple[float, str, str]:
    """``(figure, where, text)`` of the lesson text most similar to ``block``, over ``lessons``
    (default: the solution's lesson and every earlier one); ``where`` names the lesson and the cell."""
    tokens = normalised_tokens(block)
    exact = normalised_tokens(block, keep_names=True)
    best = (0.0, "nothing", "")
    for lesson in _lessons_up_to(solution) if lessons is None else lessons:
        for where, text in lesson_texts(lesson):
            if len(tokens) < SHORT:
                figure = 1.0 if exact and _contains(normalised_tokens(text, keep_names=True), exact) else 0.0
            else:
                figure = similarity(tokens, normalised_tokens(text))
            if figure > best[0]:
                best = (figure, f"notebooks/{lesson.name}, {where}", text)
    return best


SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
BLOCKS = [(path, name, block) for path in SOLUTIONS for name, block in solution_blocks(path)]


def test_every_solution_has_blocks_and_a_lesson():
    assert SOLUTIONS
    for path in SOLUTIONS:
        assert solution_blocks(path), f"{path.name} has no solution block"
        _lesson_for(path)
        lessons = _lessons_up_to(path)
        assert lessons[0].name.startswith("00_") and lessons[-1] == _lesson_for(path)


def test_earlier_lessons_are_compared_too():
    """A causal mask printed in lesson 00 is as copyable as one printed in lesson 03."""
    (path,) = [p for p in SOLUTIONS if p.name.startswith("03_")]
    block = "return torch.arange(S)[None, :] <= torch.arange(L)[:, None]"
    assert [p.name[:2] for p in _lessons_up_to(path)] == ["00", "01", "02", "03"]
    figure, where, _ = closest(path, block, lessons=[])
    assert figure == 0.0 and where == "nothing"


def test_the_measure_tells_a_copy_from_a_lesson_that_teaches():
    """Renamed and recommented copies score 1; the same idea written differently scores low."""
    solution = normalised_tokens(
        "scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])\nreturn torch.softmax(scores, -1) @ v"
    )
    copied = normalised_tokens(
        'def f(a, b, c):\n    """Doc."""\n    s = a @ b.transpose(-2, -1) / math.sqrt(a.shape[-1])  # scores\n'
        "    return torch.softmax(s, -1) @ c\n"
    )
    assert similarity(solution, copied) == 1.0
    other = normalised_tokens(
        "w = torch.einsum('ld,sd->ls', q, k).div(8 ** 0.5).softmax(-1)\nout = torch.einsum('ls,sd->ld', w, v)"
    )
    assert similarity(solution, other) < LIMIT
    assert normalised_tokens("x.tril()  # note") == ["ID", ".", "tril", "(", ")"]


@pytest.mark.parametrize(
    "path,name,block", BLOCKS, ids=[f"{p.name[:2]}:{n}" for p, n, _ in BLOCKS]
)
def test_solution_is_not_printed_in_its_lesson(path, name, block):
    figure, where, text = closest(path, block)
    rule = (f"exact match (a short block, under {SHORT} tokens)" if len(normalised_tokens(block)) < SHORT
            else f"{RUN}+ token runs shared")
    assert figure < LIMIT, (
        f"solutions/{path.name}, {name}: {figure:.2f} of the solution block ({rule}) appears in "
        f"{where} (limit {LIMIT}). Teach the idea without printing the "
        f"answer (another function or shape, the maths, the library as a black box).\n"
        f"--- solution block ---\n{textwrap.dedent(block)}\n--- {where} ---\n{text[:4000]}"
    )


if __name__ == "__main__":  # the figure for every block, and the closest pair per lesson
    per_lesson: dict[str, tuple[float, str]] = {}
    for path, name, block in BLOCKS:
        figure, where, _ = closest(path, block)
        later, later_where, _ = closest(path, block, lessons=_later_lessons(path))
        print(f"{path.name[:2]} {name:32s} {figure:.2f}  {where}   | later lessons (not tested): {later:.2f} {later_where}")
        per_lesson[path.name[:2]] = max(per_lesson.get(path.name[:2], (0.0, "")), (figure, name))
    print("closest pair per lesson:", ", ".join(f"{k}: {v[0]:.2f} ({v[1]})" for k, v in sorted(per_lesson.items())))
