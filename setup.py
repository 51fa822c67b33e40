"""Installs the package ``tokengym`` from the folders llm_envs/, transforms/, collectors/."""

from setuptools import setup

setup(
    name="tokengym",
    version="0.1.0",
    description="TensorDict-native token-level environments and collectors for RL on language models",
    python_requires=">=3.11",
    packages=["tokengym", "tokengym.llm_envs", "tokengym.transforms", "tokengym.collectors"],
    package_dir={
        "tokengym": "tokengym",
        "tokengym.llm_envs": "llm_envs",
        "tokengym.transforms": "transforms",
        "tokengym.collectors": "collectors",
    },
    package_data={"tokengym": ["py.typed"]},
    install_requires=[
        "torch>=2.5",
        "tensordict>=0.14.3,<0.15",
        "torchrl==0.14.1",
        "transformers>=5,<6",
        "tokenizers",
        "gymnasium>=1,<2",
        "datasets",
        "numpy",
    ],
    extras_require={
        "test": ["pytest", "pytest-benchmark", "hypothesis", "ruff"],
        "demo": ["matplotlib", "tqdm"],
    },
    entry_points={"console_scripts": ["tokengym=tokengym.__main__:main"]},
)
