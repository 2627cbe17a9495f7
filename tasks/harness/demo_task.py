"""`demo-continuation`: a multiple-choice task in lm-eval's own format, written from a shard set's val split (documents
never trained on: data_prep assigns whole documents to val by content hash).

Each example is a passage of a val document (`context`, whole words up to 256 characters) and four choices of the
same length in characters to continue it: the passage's true next 16 characters, and 16 characters cut the same way
(from a word boundary) from other val documents (fixed seed). The task is text (JSONL + a task YAML that `lm_eval`
loads like any other), so models with different tokenizers are scored on the same thing. It is scored by lm-eval's
`acc_mutual_info` (log P(choice | passage) − log P(choice)): how much the passage raises each choice, so a span that
is likely anywhere (indentation, `else:`) does not win by itself; the demo model trained by `make run` picks the true
continuation about 0.57 of the time (chance: 1/4; 0.573 FP32, 0.577 INT8 on 2026-12-03).

The val windows are decoded with the shard set's tokenizer, put back in stream order by their keys (the window
index), and cut into pieces at EOS tokens (document boundaries) and at missing windows. `keep(key)` chooses the
windows whose text may be used (the caller passes the evaluation part of the quantize/evaluate split, so no
calibration token is evaluated on); every window counts for document boundaries.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import StageError
from tasks.fsutil import atomic_write_json, read_json, recover_dir, sha256_file, swap_dir

NAME = "demo-continuation"
FORMAT = 2  # bump when the construction changes: a task written by another rule is rebuilt (2: fewshot_split)
CHOICES = 4
CONTEXT_CHARS = (48, 256)  # a passage of at least / at most this many characters
SPAN_CHARS = 16  # every choice: this many characters from a word boundary
MIN_EXAMPLES = 10
MAX_TOKENS = 4_000_000  # val tokens read at most (a prefix of the file order): enough text for any demo task
_UNIT = re.compile(r"\s*\S+")


@dataclass
class Piece:
    doc: int  # document number (EOS tokens and missing windows seen so far)
    units: list[str]  # whitespace + word, in order: "".join(units) is the text


def _windows(shard_dir: Path) -> tuple[dict[int, list[int]], int]:
    from data_prep.errors import DataPrepError
    from data_prep.loader import ShardLoader
    from data_prep.manifest import load_manifest

    try:
        manifest = load_manifest(shard_dir)
        windows, tokens = {}, 0
        if manifest["splits"].get("val", {}).get("samples", 0):
            loader = ShardLoader(shard_dir, split="val", batch_size=1, num_workers=0, shuffle=False, with_keys=True)
            for x, y, keys in loader:
                windows[int(keys[0])] = x[0].tolist() + y[0, -1:].tolist()
                tokens += y.size(1) + 1
                if tokens >= MAX_TOKENS:
                    break
    except DataPrepError as e:
        raise StageError(f"{NAME}: {e}") from None
    return windows, manifest["eos_id"]


def _pieces(windows: dict[int, list[int]], eos: int, keep, decode) -> list[Piece]:
    pieces, doc, run, prev = [], 0, [], None

    def flush():
        if run:
            text = decode(run)
            units = _UNIT.findall(text)
            if units:
                pieces.append(Piece(doc, units))
            run.clear()

    for key in sorted(windows):
        if prev is not None and key != prev + 1:  # a window missing from the stream: treat it as a boundary
            flush()
            doc += 1
        prev = key
        if not keep(key):
            flush()
        for t in windows[key]:
            if t == eos:
                flush()
                doc += 1
            elif keep(key):
                run.append(t)
    flush()
    return pieces


def _span(units: list[str], start: int) -> str | None:
    """The SPAN_CHARS characters from a word boundary (with the whitespace before the word), if enough of them are
    not whitespace: every choice has the same length in characters, whatever tokenizer reads it."""
    text = "".join(units[start : start + SPAN_CHARS])[:SPAN_CHARS]
    return text if len(text) == SPAN_CHARS and len(text.strip()) >= SPAN_CHARS // 4 else None


def _example(piece: Piece, cut: int, pieces: list[Piece], rng: random.Random) -> dict | None:
    """Context = whole words before `cut`, true span = the characters after it, distractors = spans of other docs."""
    context = ""
    for u in reversed(piece.units[:cut]):
        if len(context) + len(u) > CONTEXT_CHARS[1]:
            break
        context = u + context
    true = _span(piece.units, cut)
    if len(context) < CONTEXT_CHARS[0] or true is None:
        return None
    choices = {true}
    for _ in range(50):
        if len(choices) == CHOICES:
            break
        other = rng.choice(pieces)  # a span starting after whitespace, as the true one does
        if other.doc != piece.doc and len(other.units) > 1:
            if span := _span(other.units, rng.randrange(1, len(other.units))):
                choices.add(span)
    if len(choices) < CHOICES:
        return None
    wrong = sorted(choices - {true})
    rng.shuffle(wrong)
    label = rng.randrange(CHOICES)
    return {"context": context.lstrip(), "choices": wrong[:label] + [true] + wrong[label:], "label": label}


def examples(shard_dir: Path, n: int, seed: int, keep) -> list[dict]:
    """Up to `n` examples, one per passage in a seeded order, then a second cut of each passage, and so on."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(shard_dir / "tokenizer.json"))
    windows, eos = _windows(shard_dir)
    pieces = _pieces(windows, eos, keep, lambda ids: tok.decode(ids))
    rng = random.Random(seed)
    cuts = []
    for p in pieces:
        c = list(range(1, len(p.units)))
        rng.shuffle(c)
        cuts.append(c)
    order = list(range(len(pieces)))
    rng.shuffle(order)
    out = []
    while len(out) < n and any(cuts):
        for i in order:
            if len(out) < n and cuts[i] and (ex := _example(pieces[i], cuts[i].pop(), pieces, rng)) is not None:
                out.append(ex)
    if len(out) < min(n, MIN_EXAMPLES):
        docs = len({p.doc for p in pieces})
        # one document, however long, gives none: an example's wrong choices are spans of other documents
        why = ", all of one document: the wrong choices come from other documents" if docs == 1 else ""
        raise StageError(
            f"{NAME}: the val split of {shard_dir} gives {len(out)} examples ({len(windows)} windows, "
            f"{len(pieces)} passages{why}), fewer than {min(n, MIN_EXAMPLES)}; reshard with a larger "
            "data.val_fraction or corpus, or evaluate on other evaluate.tasks"
        )
    return out


def yaml_text(jsonl: Path, source: str) -> str:
    return "\n".join(
        [
            f"# {NAME}: written by tasks/harness/demo_task.py from {source}",
            f"task: {NAME}",
            "dataset_path: json",
            "dataset_kwargs:",
            "  data_files:",
            f"    test: {json.dumps(str(jsonl))}",
            "test_split: test",
            # shots (evaluate.num_fewshot) come from the same rows: named, lm-eval leaves the prompt's own row out
            # (left to its fallback, a prompt could show its own answer as an example)
            "fewshot_split: test",
            "output_type: multiple_choice",
            "doc_to_text: context",
            "doc_to_choice: choices",
            "doc_to_target: label",
            'target_delimiter: ""',
            "metric_list:",  # log P(choice | passage) − log P(choice): how much the passage makes the choice likelier
            "  - metric: acc_mutual_info",
            "    aggregation: mean",
            "    higher_is_better: true",
            "metadata:",
            f"  version: {FORMAT}.0",
            "",
        ]
    )


def write(shard_dir: Path, out: Path, n: int, seed: int, keep, keep_rule: str) -> Path:
    """The task folder `out` (NAME.yaml, NAME.jsonl, meta.json) for this shard set; reused when already written from
    the same manifest with the same settings and its JSONL is intact. Returns the YAML's path."""
    from data_prep.manifest import digest

    key = {"format": FORMAT, "manifest_sha256": digest(shard_dir), "examples": n, "seed": seed, "rule": keep_rule}
    recover_dir(out)
    meta = out / "meta.json"
    if meta.is_file() and (m := read_json(meta)).get("key") == key:
        if (out / f"{NAME}.jsonl").is_file() and sha256_file(out / f"{NAME}.jsonl") == m["jsonl_sha256"]:
            return out / f"{NAME}.yaml"
    rows = examples(shard_dir, n, seed, keep)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        jsonl = tmp / f"{NAME}.jsonl"
        jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        source = f"the val split of {shard_dir} (manifest sha256 {key['manifest_sha256'][:12]}…; {keep_rule})"
        (tmp / f"{NAME}.yaml").write_text(yaml_text(out / jsonl.name, source), encoding="utf-8")
        atomic_write_json(tmp / "meta.json", {"key": key, "examples": len(rows), "jsonl_sha256": sha256_file(jsonl)})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_dir(tmp, out)
    return out / f"{NAME}.yaml"


def task_digest(folder: Path) -> str:
    """Identity of a written task (its JSONL), for MLflow and for reusing measurements."""
    return hashlib.sha256((folder / f"{NAME}.jsonl").read_bytes()).hexdigest()
