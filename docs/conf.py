"""Sphinx configuration of tokengym's documentation (``make docs``: warnings are errors, nitpicky)."""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent / "_ext"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

project = "tokengym"
author = "tokengym contributors"
copyright = "2026, tokengym contributors"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "tokengym_api",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "tokengym"
html_static_path = ["_static"]
html_css_files = ["wrap-code.css"]  # code blocks wrap at the page width

# No intersphinx: the build runs offline. References into torch, tensordict, transformers... stay plain
# text; every reference to a tokengym name must resolve (nitpicky, and `make docs` turns warnings into errors).
nitpicky = True
_EXTERNAL = (
    "torch", "tensordict", "torchrl", "transformers", "tokenizers", "numpy", "np", "gymnasium", "datasets",
    "httpx", "ray", "vllm", "safetensors", "websockets", "reasoning_gym", "textarena", "math_verify",
    "collections", "typing", "typing_extensions", "pathlib", "os", "enum", "dataclasses", "threading",
    "asyncio", "logging", "subprocess", "concurrent", "contextlib", "queue", "types", "random", "re", "json",
    "abc", "io", "socket", "tempfile", "functools", "inspect", "_thread", "starlette", "fractions", "ast",
)  # fmt: skip
nitpick_ignore_regex = [(r"py:.*", rf"({'|'.join(_EXTERNAL)})(\..*)?")]
# internal types that appear in the signature of a documented base class or handler; not for users to build
nitpick_ignore = [("py:class", "tokengym.collectors.core.CollectSpec"),
                  ("py:class", "tokengym.llm_envs.adapters._episodes.EpisodeSource"),
                  ("py:class", "tokengym.llm_envs.agents.chat_app.RequestRefused"),
                  ("py:class", "tokengym.collectors._packing.Step"),  # a StepSource's chunk
                  ("py:class", "tokengym.collectors.tree_sampler.TreeSampler")]  # what a TreeSource drives

autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True
autodoc_class_signature = "mixed"
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
add_module_names = False
python_maximum_signature_line_length = 100

