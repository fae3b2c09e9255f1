"""Sphinx configuration for flashcore's documentation (MyST Markdown + autodoc).

Build: sphinx-build -W --keep-going -b html docs docs/_build/html
"""
import importlib
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))           # document the checkout, installed or not
sys.path.insert(0, str(DOCS / "scripts"))

import flashcore  # noqa: E402
import make_plots  # noqa: E402

project = "flashcore"
author = "the flashcore developers"
copyright = "the flashcore developers"
release = flashcore.__version__
version = ".".join(release.split(".")[:2])

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "_generated", "scripts", "Thumbs.db", ".DS_Store"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
html_theme = "alabaster"
html_static_path = []
html_theme_options = {"description": "exact attention, the FlashAttention way"}

# ---- generated content (never hand-typed) -------------------------------------------------
# 1. The benchmark page's plots and tables, from the committed asv results.
# (FLASHCORE_ASV_RESULTS points at another results folder, to preview the page.)
import os  # noqa: E402
make_plots.generate(Path(os.environ.get("FLASHCORE_ASV_RESULTS", ROOT / "asv_benchmarks" / "results")),
                    DOCS / "_generated")

# 2. The reference of the optional modules that exist in this checkout.
_OPTIONAL = [
    ("flashcore.flash_attn", "flash-attn compatible functions"),
    ("flashcore.integrations.transformers", "Hugging Face transformers integration"),
]
_lines = []
for _mod, _title in _OPTIONAL:
    try:
        importlib.import_module(_mod)
    except ImportError:
        _lines += [f"## `{_mod}`", "", f"Not part of this build of flashcore yet.", ""]
        continue
    _lines += [f"## `{_mod}`: {_title}", "", "```{eval-rst}", f".. automodule:: {_mod}",
               "   :members:", "```", ""]
(DOCS / "_generated" / "api_optional.md").write_text("\n".join(_lines))
