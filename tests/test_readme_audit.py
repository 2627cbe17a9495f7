"""README's promises that can be checked without running anything: every link to a page (and its section) exists,
every `make` target it names is in the Makefile, every preset it names is in configs/, every `python -m tasks <stage>`
names a stage. Static and in-process (< 1 CPU s): the commands themselves are tried by hand in the audits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces → '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    out, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            out.add(_slug(m.group(1)))
    return out


def link_problems(page: Path, text: str) -> list[str]:
    """Relative links of `text` (the page `page`) whose file or `#section` does not exist."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path) if path else page
        if not file.exists():
            problems.append(f"{page.name}: {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            problems.append(f"{page.name}: {target}: no section #{anchor} in {file.name}")
    return problems


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w.-]*):", (REPO / "Makefile").read_text(), re.M))


def readme_make_targets(text: str) -> set[str]:
    """The targets of every `make X …` in README's code (inline or fenced), variables like CONF=… left out."""
    fenced = re.findall(r"```\w*\n(.*?)```", text, re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```\w*\n.*?```", "", text, flags=re.S))
    code = "\n".join(fenced + inline)  # one span a line: `make` and the next span are not one command
    return {m for m in re.findall(r"\bmake ([a-z][\w-]*)", code)}


def readme_presets(text: str) -> set[str]:
    named = re.findall(r"--config ([a-z0-9][\w.-]*)", text) + re.findall(r'"preset": "([\w.-]+)"', text)
    named += re.findall(r"`([a-z0-9]+(?:-[a-z0-9]+)*-(?:910[abc]|h100|2node|tiny|cpu))`", text)
    return set(named)


def readme_stages(text: str) -> set[str]:
    return set(re.findall(r"python -m tasks ([a-z_]+)", text))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_sections_exist(page):
    assert link_problems(page, page.read_text()) == []


def test_link_check_sees_a_missing_section_and_file():
    text = "[a](docs/stages.md#no-such-section) [b](docs/nosuch.md) [c](docs/stages.md#the-stages-one-by-one)"
    assert link_problems(README, text) == [
        "README.md: docs/stages.md#no-such-section: no section #no-such-section in stages.md",
        "README.md: docs/nosuch.md: no such file",
    ]


def test_make_targets_named_in_readme_exist():
    named = readme_make_targets(README.read_text())
    assert {"run", "test", "bench", "ui", "stop", "test-fast", "lint", "npu-api", "device-check"} <= named
    assert named - make_targets() == set()


def test_presets_named_in_readme_exist():
    named = readme_presets(README.read_text())
    assert {"ci-tiny", "llama3-70b-910c", "qwen2-7b-910b", "llama3-8b-h100"} <= named
    presets = {p.stem for p in (REPO / "configs").glob("*.yaml")}
    assert named - presets == set()


def test_stages_named_in_readme_exist():
    from tasks.stages import OWN_SCHEDULE, STAGES

    named = readme_stages(README.read_text())
    assert {"plan", "shard", "smoke", "train", "evaluate"} <= named
    assert named - (set(STAGES) | set(OWN_SCHEDULE) | {"summary"}) == set()


NUMBERS = ("one two three four five six seven eight nine ten eleven twelve").split()


def test_every_written_list_of_the_stages_names_each_stage():
    """The places docs/contributing.md ("A stage") sends a new stage's author, beyond the tests that spell the chain
    out (test_dags, test_k8s_launcher): README's stage table and its one paragraph each, ARCHITECTURE.md's stage
    count, main DAG chain and `stages/` line, the DAG's docstring (its description in the UI) and docs/stages.md
    (its command). A stage added to STAGES and missed in one of them fails here, naming it."""
    from tasks.stages import STAGES

    readme = README.read_text()
    table = readme[readme.index("## The stages") : readme.index("In one paragraph each")]
    paragraphs = readme[readme.index("In one paragraph each") :].split("\n## ")[0]
    arch = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    chain = next(line for line in arch.splitlines() if line.startswith("dags/llm_pipeline.py"))
    stages_line = arch[arch.index("  stages/ ") :].split("\n  launch/")[0]
    stages_md = (REPO / "docs" / "stages.md").read_text()
    dag_doc = (REPO / "dags" / "llm_pipeline.py").read_text().split('"""')[1]
    dag_chain = dag_doc[dag_doc.index("(`python -m tasks <stage>`):") :].split(". ")[0]
    assert f"The pipeline is {NUMBERS[len(STAGES) - 1]} stages" in arch, "ARCHITECTURE.md's stage count"
    assert dag_chain.count("→") == len(STAGES) - 1, f"dags/llm_pipeline.py's docstring chain: {dag_chain!r}"
    for stage in STAGES:
        missing = [
            where
            for where, found in {
                "README's stage table": f"`tasks/stages/{stage}.py`" in table,
                "README's paragraph each": f"**{stage}**" in paragraphs,
                "ARCHITECTURE.md's main DAG chain": f" {stage} " in f"{chain} ",
                "ARCHITECTURE.md's stages/ line": re.search(rf"\b{stage}\b", stages_line) is not None,
                "docs/stages.md": f"python -m tasks {stage}" in stages_md,
            }.items()
            if not found
        ]
        assert not missing, f"stage {stage} is not in {missing}"


def test_every_documented_cli_trigger_comes_after_an_unpause_of_its_dag():
    """DAGs start paused (airflow.cfg: dags_are_paused_at_creation), and `airflow dags trigger D` does not unpause
    D: the run stays queued for ever. A page that triggers D from the command line unpauses it first (docs/data.md
    and docs/real-size.md did not)."""
    assert re.search(r"^dags_are_paused_at_creation = True$", (REPO / "airflow.cfg").read_text(), re.M)
    missing = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"airflow dags trigger (\w+)", text):
            if f"airflow dags unpause {m.group(1)}" not in text[: m.start()]:
                missing.append(f"{page.relative_to(REPO)}: {m.group(0)}")
    assert not missing, missing
