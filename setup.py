"""Packaging for jagg-autograd.

Everything installs from ``src/``; the Triton kernels are ``src/jagg_autograd/kernels/``.
"""

from setuptools import find_packages, setup

_TEST = ["pytest>=8", "hypothesis>=6.100", "ruff>=0.5", "triton>=3.0"]
# transformers >= 5.25 imports Hugging Face's top-level `kernels` package: nothing in this
# repository may be an importable top-level `kernels` (the Triton kernels used to be the
# repository root's kernels/ folder, which shadowed it under `python -m` and pytest).
_TRANSFORMERS = "transformers>=4.40"
_DIFFUSERS = ["diffusers>=0.31", "peft>=0.13", _TRANSFORMERS, "accelerate>=0.34"]
_DEMO = [
    "diffusers>=0.31",
    "peft>=0.13",  # jagg-demo --tuning lora, the LoRA adapters and the KL reference
    _TRANSFORMERS,
    "safetensors>=0.4",
    "scikit-learn>=1.3",
    "matplotlib>=3.7",
    "tqdm>=4.60",
    "pyyaml>=5.1",  # jagg-demo --config FILE.yaml
]
_BENCH = ["matplotlib>=3.7", "tqdm>=4.60"]
# --report-to (jagg_autograd.tracking): optional; tensorboard is small enough for the tests.
_TENSORBOARD = ["tensorboard>=2.10"]
_WANDB = ["wandb>=0.16"]

setup(
    name="jagg-autograd",
    version="0.1.0",
    description="JAGG: Jacobian-aggregated gradients for cheap GRPO on flow-matching DiTs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    package_dir={"": "src"},
    packages=find_packages("src"),
    package_data={"jagg_autograd": ["assets/*.safetensors", "assets/*.json"]},
    # 2.13.0 (the CPU build CI pins) satisfies this range; a bare "torch" would let a
    # resolver pull a multi-GB CUDA build on machines that have no torch yet.
    install_requires=["torch>=2.4,<2.14", "numpy>=1.24", "scipy>=1.10", *_DEMO],
    extras_require={
        "triton": ["triton>=3.0"],
        "test": _TEST + _DIFFUSERS + _TENSORBOARD,
        "diffusers": _DIFFUSERS,
        "bench": _BENCH + _DIFFUSERS,
        "tensorboard": _TENSORBOARD,
        "wandb": _WANDB,
    },
    entry_points={"console_scripts": ["jagg-demo=jagg_autograd.demo:main"]},
)
