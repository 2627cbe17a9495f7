"""The lm-eval adapter (tasks.harness.lm) against lm-eval's own HFLM on inputs test_harness.py does not use — a
tokenizer that adds a BOS token (SentencePiece-style, Metaspace) — and the inputs it cannot score as lm-eval would:
a continuation the tokenizer merges into the context, generation kwargs greedy decoding cannot honour, few-shot
settings the shard stage must check even when evaluate.tasks is only demo-continuation."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from tasks.errors import StageError

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _bos_tokenizer(vocab: int = 320):
    """A SentencePiece-style BPE (Metaspace, `<s>` added in front of every text by its post-processor, `</s>` EOS), as
    transformers' fast tokenizer: what Llama/Mistral checkpoints ship, unlike tests.helpers.models.stdlib_bpe."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = sorted(set((STDLIB / "bisect.py").read_text()) | {"▁"})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False, initial_alphabet=alphabet
    )
    tok.train([str(STDLIB / name) for name in ("textwrap.py", "bisect.py")], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def bos_lms(tmp_path_factory):
    """(ours, lm-eval's HFLM) on a tiny Qwen2 saved by transformers with a BOS-adding tokenizer, context 128."""
    import transformers

    from tasks.harness import suite
    from tasks.harness.lm import ProjectLM
    from tasks.harness.models import full_precision, load_tokenizer
    from tests.helpers.models import tiny_qwen2

    path = tmp_path_factory.mktemp("hf-bos")
    tiny_qwen2(path, tokenizer=_bos_tokenizer(), hidden_size=32, intermediate_size=48, num_hidden_layers=1)
    suite.offline()
    from lm_eval.models.huggingface import HFLM

    # tokenizer.json as it is (AutoTokenizer would take Qwen2's class from config.json: another pre-tokenizer)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    hf = HFLM(pretrained=str(path), tokenizer=tok, backend="causal", device="cpu", dtype="float32", batch_size=4)
    ours = ProjectLM(full_precision(path, "fp32", "cpu"), load_tokenizer(path), "cpu", batch_size=4)
    assert ours.tok.bos_id == 1 and ours.tok_encode("x")[0] == 1 and ours.max_length == hf.max_length == 128
    return ours, hf


def _requests(kind: str, args: list) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_bos_tokenizer_scores_as_hflm(bos_lms):
    """With a BOS the tokenizer adds: shared and single contexts, an empty context (BOS as context, the continuation
    without a second BOS), a context ending in spaces, one beyond the 128-token context (left-truncated), rolling
    windows over a text of several windows: HFLM's log-likelihoods within 1e-4, the same greedy flags; greedy
    generation (a prompt beyond the context too): the same text."""
    ours, hf = bos_lms
    text = (STDLIB / "textwrap.py").read_text()
    args = [(text[100:300], text[a : a + 12]) for a in (900, 1500, 2100)]  # one context, three choices
    args += [("", "def wrap(text):"), ("x = ", "1"), (text[:2500], " return x"), (text[3000:3100], " self")]
    want, got = hf.loglikelihood(_requests("loglikelihood", args)), ours.loglikelihood(_requests("loglikelihood", args))
    assert max(abs(w[0] - g[0]) for w, g in zip(want, got)) < 1e-4, (want, got)
    assert [w[1] for w in want] == [g[1] for g in got]
    rolling = [(text[:1200],), (text[5000:5300],)]
    want = hf.loglikelihood_rolling(_requests("loglikelihood_rolling", rolling))
    got = ours.loglikelihood_rolling(_requests("loglikelihood_rolling", rolling))
    assert max(abs(w - g) for w, g in zip(want, got)) < 1e-4, (want, got)
    gen = [(text[:40], {"until": ["\n\n"], "max_gen_toks": 6}), (text[:2500], {"until": ["def"], "max_gen_toks": 6})]
    want = hf.generate_until(_requests("generate_until", gen))
    assert ours.generate_until(_requests("generate_until", gen)) == want and any(want)


def test_a_continuation_merged_into_the_context_is_one_line(bos_lms):
    """A choice the tokenizer merges into the context's last token has no token of its own: lm-eval's HFLM stops on a
    bare AssertionError; ours scored it log P = 0 (probability 1: always picked) alone, or failed deep in the
    attention (a 0-length row) beside other choices. Now one line naming the task, the choice and the fix."""
    ours, _ = bos_lms
    whole, ctx = ours.tok_encode("return"), ours.tok_encode("retur")
    assert len(whole) <= len(ctx)  # "return" is no more tokens than "retur": "n" adds none after it
    for args in ([("retur", "n")], [("retur", "n"), ("retur", "ned")]):
        reqs = _requests("loglikelihood", args)
        for r in reqs:
            r.task_name = "my_quiz"
        with pytest.raises(StageError, match=r"^evaluate: task my_quiz: the continuation 'n' of the context .*'retur'"):
            ours.loglikelihood(reqs)


def _gen_yaml(folder: Path, name: str, extra: str) -> Path:
    rows = [{"question": "x = 1\ny =", "answer": " 2"}] * 3
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = folder / f"{name}.yaml"
    path.write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / f'{name}.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: exact_match\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n" + extra
    )
    return path


def test_generation_kwargs_greedy_decoding_cannot_honour_are_refused(tmp_path, bos_lms):
    """A task YAML's num_beams (lm-eval's code2text tasks: 10), repetition_penalty or max_length were ignored: the
    models were scored on plain greedy text while HFLM runs the beam search. Refused by load (one line, before any
    model; the shard stage's check) and by the adapter itself; sampling's knobs under do_sample false still load."""
    from tasks.harness import suite

    for key, value in [("num_beams", 10), ("repetition_penalty", 1.3), ("max_length", 40)]:
        path = _gen_yaml(tmp_path, f"gen_{key}", f"  {key}: {value}\n")
        with pytest.raises(StageError, match=rf"^evaluate.tasks: task gen_{key} generates with generation_kwargs."):
            suite.load([str(path)], None, None, {}, ["exact_match"])
    ok = _gen_yaml(tmp_path, "gen_ok", "  do_sample: false\n  temperature: 0.0\n  top_p: 0.95\n  num_beams: 1\n")
    assert suite.load([str(ok)], None, None, {}, ["exact_match"]).entries == {str(ok): ["gen_ok"]}
    # docs/evaluation.md's sentence: a temperature above 0 samples unless do_sample is false; top_k & co. do nothing
    hot = _gen_yaml(tmp_path, "gen_temp", "  temperature: 0.7\n")
    with pytest.raises(StageError, match=r"task gen_temp samples \(do_sample/temperature\).*do_sample: false"):
        suite.load([str(hot)], None, None, {}, ["exact_match"])
    for name, extra in [("gen_cool", "  temperature: 0.7\n  do_sample: false\n"), ("gen_top_k", "  top_k: 5\n")]:
        path = _gen_yaml(tmp_path, name, extra + "  min_p: 0.1\n  typical_p: 0.9\n")
        assert suite.load([str(path)], None, None, {}, ["exact_match"]).entries == {str(path): [name]}
    ours, _ = bos_lms
    reqs = _requests("generate_until", [("x =", {"until": ["\n"], "max_gen_toks": 4, "num_beams": 3})])
    with pytest.raises(StageError, match=r"generation_kwargs.num_beams: 3, which the models' greedy decoding cannot"):
        ours.generate_until(reqs)
    assert ours.generate_until(_requests("generate_until", [("x =", {"until": ["\n"], "max_gen_toks": 4})]))


def test_shard_checks_num_fewshot_when_the_tasks_are_only_demo_continuation(tmp_path):
    """evaluate.num_fewshot naming no task, or more shots than demo-continuation's rows, passed the shard stage when
    evaluate.tasks was the default [demo-continuation] and stopped the run only at quantize, after training."""
    from data_prep.testing import tiny_shard_set
    from tasks.config import load_config
    from tasks.quant.gate import check_suite

    shards = tiny_shard_set(tmp_path / "d", seq_len=64, vocab_size=512, n_docs=60, val_fraction=0.3, shard_multiple=1)
    base = ["evaluate.tasks=[demo-continuation]", "evaluate.demo_examples=20"]
    for sets, match in [
        (["evaluate.num_fewshot={quiz_x: 2}"], r"^evaluate.num_fewshot: 'quiz_x' is none of evaluate.tasks"),
        (["evaluate.num_fewshot={demo-continuation: 50}"], r"task demo-continuation asks for 50 few-shot examples"),
    ]:
        with pytest.raises(StageError, match=match):
            check_suite(load_config("ci-tiny", sets=base + sets), tmp_path / "run", shards)
    check_suite(load_config("ci-tiny", sets=[*base, "evaluate.num_fewshot={demo-continuation: 2}"]), tmp_path, shards)


def test_demo_continuation_shots_never_show_a_prompt_its_own_row(tmp_path):
    """demo-continuation's few-shot examples come from its own rows (its only split). Its YAML named no fewshot_split,
    so lm-eval drew them without leaving the prompt's row out: with 19 shots of 20 rows, nearly every prompt showed
    its own passage and true continuation as an example. Named, lm-eval leaves it out (at most 19 shots then)."""
    from data_prep.testing import tiny_shard_set
    from tasks.harness import demo_task, suite
    from tasks.quant.gate import demo_keep

    shards = tiny_shard_set(tmp_path / "d", seq_len=64, vocab_size=512, n_docs=60, val_fraction=0.3, shard_multiple=1)
    yaml = demo_task.write(shards, tmp_path / "t", 20, 0, demo_keep, "evaluation part")
    with pytest.raises(StageError, match=r"has 20 rows \(one is the prompt itself\); use at most 19 shots"):
        suite.load(["demo-continuation"], yaml, None, {"demo-continuation": 20}, ["acc_mutual_info"])
    s = suite.load(["demo-continuation"], yaml, None, {"demo-continuation": 19}, ["acc_mutual_info"])
    task = s.loaded["tasks"][demo_task.NAME]
    task.set_fewshot_seed(seed=suite.SEEDS[3])
    for doc in task.eval_docs:
        prompt = str(task.fewshot_context(doc, num_fewshot=19))
        assert prompt.count(doc["context"] + doc["choices"][doc["label"]]) == 0  # its answer is nowhere before it


def test_an_include_naming_no_file_is_said_so(tmp_path):
    """A task YAML whose `include:` (its own, or one of the YAML it includes) names no file was reported as "its
    dataset is not on disk ... fetch it into the HF datasets cache": the wrong cause and the wrong fix."""
    from tasks.harness import suite

    (tmp_path / "quiz.jsonl").write_text(json.dumps({"question": "1 + 1 =", "choices": [" 2", " 3"], "answer": 0}))
    (tmp_path / "_template_yaml").write_text(
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'quiz.jsonl'}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n"
    )
    (tmp_path / "good.yaml").write_text("include: _template_yaml\ntask: inc_good\n")
    assert suite.load([str(tmp_path / "good.yaml")], None, None, {}, ["acc"]).entries[str(tmp_path / "good.yaml")]
    (tmp_path / "typo.yaml").write_text("include: _template.yaml\ntask: inc_typo\n")
    (tmp_path / "nested.yaml").write_text("include: typo.yaml\ntask: inc_nested\n")
    for name in ("typo.yaml", "nested.yaml"):
        with pytest.raises(StageError) as e:
            suite.load([str(tmp_path / name)], None, None, {}, ["acc"])
        assert str(e.value) == (
            f"evaluate.tasks: {tmp_path / name}: include: '_template.yaml' (in typo.yaml) names no file "
            f"({tmp_path / '_template.yaml'}: an include is read from the including YAML's folder); write the name "
            "of an existing YAML"
        )


def test_generation_from_an_empty_prompt_starts_at_the_prefix_token(bos_lms):
    """A generation request whose context is empty, with a tokenizer that adds no BOS: a 0-length prompt failed deep
    in the model (a traceback mid-scoring; HFLM's generate fails the same way). It starts from the prefix token (EOS
    here), as lm-eval's loglikelihood does for an empty context: the same text as a prompt of that token alone."""
    from tokenizers import Tokenizer

    from tasks.harness.lm import ProjectLM
    from tasks.harness.models import TextTokenizer

    ours, _ = bos_lms
    raw = Tokenizer.from_str(ours.tok.tok.to_str())
    raw.post_processor = None  # the same vocabulary, no BOS added
    tok = TextTokenizer(raw, ours.tok.eos_id, None, None, "no-bos")
    lm = ProjectLM(ours.model, tok, "cpu", batch_size=2)
    assert lm.tok_encode("") == [] and lm.prefix_token_id == tok.eos_id
    kw = {"until": ["\n\n"], "max_gen_toks": 6}
    got = lm.generate_until(_requests("generate_until", [("", kw), ("def f(x):", kw)]))
    assert got[0] == lm.tok.decode(lm._greedy([[tok.eos_id]], 6, ["\n\n"])[0]).split("\n\n")[0]
    assert got[1] == lm.generate_until(_requests("generate_until", [("def f(x):", kw)]))[0]  # its batch-mate unchanged


def test_a_task_with_a_filter_list_is_scored_through_its_first_filter(tmp_path, bos_lms):
    """lm-eval reports a task with a filter_list per filter ("exact_match,strict-match": gsm8k); score read only
    "exact_match,none" and stopped on a KeyError after the model had generated every answer. Now the YAML's first
    filter (here: the first character, which every target is; the second filter, the whole text, would score 0)."""
    from tasks.harness import suite

    ours, _ = bos_lms
    questions = ["x = 1\ny =", "def f(a):\n    return", "for i in range(3):\n   "]
    kw = {"until": ["\n"], "max_gen_toks": 5}
    gens = ours.generate_until(_requests("generate_until", [(q, kw) for q in questions]))
    first = [g.strip()[:1] for g in gens]
    assert all(first) and any(len(g.strip()) > 1 for g in gens)  # the whole text is not the target
    rows = [{"question": q, "answer": a} for q, a in zip(questions, first)]
    (tmp_path / "f.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "f.yaml").write_text(
        f"task: filtered\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'f.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: answer\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 5\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
        "filter_list:\n"
        "  - name: first-char\n    filter:\n      - function: regex\n        regex_pattern: '(\\S)'\n"
        "      - function: take_first\n"
        "  - name: whole\n    filter:\n      - function: take_first\n"
    )
    s = suite.load([str(tmp_path / "f.yaml")], None, None, {}, ["exact_match"])
    assert s.filters == {"filtered": "first-char"}
    assert suite.score(ours, s)["tasks"]["filtered"] == {"metric": "exact_match", "value": 1.0, "n": 3, "shots": 0}
