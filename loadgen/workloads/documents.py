"""Where rag-shuffle and shared-doc get their text: a file the user names, else the shared Lee corpus."""
from __future__ import annotations

from pathlib import Path

from loadgen.errors import UsageError
from loadgen.workloads.text import load_documents

SHARED_DOCS = Path("data") / "docs" / "lee_background.cor"


def default_docs_file() -> Path | None:
    """`../shared/data/docs/lee_background.cor` beside the repository (or beside the working directory)."""
    repo = Path(__file__).resolve().parents[2]
    for base in (repo.parent / "shared", Path.cwd().parent / "shared"):
        if (base / SHARED_DOCS).is_file():
            return base / SHARED_DOCS
    return None


def documents(docs_file: Path | None, workload: str, minimum: int = 1) -> list[str]:
    path = docs_file or default_docs_file()
    if path is None:
        raise UsageError(f"{workload} needs documents: pass --docs-file (one document per line); "
                         f"the default ../shared/data/{SHARED_DOCS} was not found")
    if not Path(path).is_file():
        raise UsageError(f"--docs-file {path}: no such file")
    docs = load_documents(Path(path))
    if len(docs) < minimum:
        raise UsageError(f"{workload} needs at least {minimum} documents; {path} has {len(docs)}")
    return docs
