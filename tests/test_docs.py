"""The repository explains itself: every "SPEC §N" a comment or page cites is a section of docs/spec.md,
and no file cites a document the repository does not hold (SPEC.md, DESIGN.md)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("ctopd_jax", "tests", "benchmarks", "scripts", "configs", "docs", "README.md")
# "SPEC §1.3, §2 and §5": the citation and the sections listed right after it
CITATION = re.compile(r"SPEC\s+§\s?\d+(?:\.\d+)?(?:(?:\s*,\s*|\s+and\s+|\s*/\s*|\s*[-–]\s*)§\s?\d+(?:\.\d+)?)*")
SECTION = re.compile(r"§\s?(\d+(?:\.\d+)?)")


def _sources():
    for tree in TREES:
        paths = [ROOT / tree] if (ROOT / tree).is_file() else sorted((ROOT / tree).rglob("*"))
        for path in paths:
            if path.suffix in (".py", ".md", ".yaml", ".sh") and path.is_file():
                yield path


def spec_sections(text: str) -> set[str]:
    """Section numbers of docs/spec.md: `## N. title` and `### N.M title` headings."""
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.?\s", text, flags=re.M))


def cited_sections(text: str) -> list[str]:
    return [n for cite in CITATION.findall(text) for n in SECTION.findall(cite)]


def test_the_citation_reader_reads_lists_and_steps():
    assert cited_sections("(SPEC §1.3, §2, §3) and SPEC §5 and §7; paper §5") == \
        ["1.3", "2", "3", "5", "7"]
    assert cited_sections("SPEC §3–§5") == ["3", "5"]
    assert spec_sections("## 1. One\n### 1.3 Re-tokenize\n## 10. Ten\n#### 4.4 no\n") == \
        {"1", "1.3", "10"}


def test_every_cited_spec_section_is_in_docs_spec():
    sections = spec_sections((ROOT / "docs" / "spec.md").read_text(encoding="utf-8"))
    missing = [f"{path.relative_to(ROOT)}: SPEC §{n}"
               for path in _sources()
               for n in cited_sections(path.read_text(encoding="utf-8"))
               if n not in sections]
    assert sections >= {str(n) for n in range(1, 11)}
    assert not missing, "cited but not in docs/spec.md:\n" + "\n".join(missing)


def test_no_file_cites_a_document_outside_the_repository():
    outside = re.compile(r"\b(?:SPEC|DESIGN)\.md\b")
    found = [str(path.relative_to(ROOT)) for path in _sources()
             if path.name != "test_docs.py" and outside.search(path.read_text(encoding="utf-8"))]
    assert not found, "cite docs/spec.md or docs/architecture.md instead: " + ", ".join(found)


def test_every_relative_link_of_the_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [f"{page.relative_to(ROOT)}: {target}"
              for page in pages
              for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8"))
              if "://" not in target and not (page.parent / target).exists()]
    assert not broken, "links to nothing: " + ", ".join(broken)
