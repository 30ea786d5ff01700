"""tfremat: activation rematerialization for TensorFlow 2 and Keras 3."""

import setuptools

setuptools.setup(
    name="tfremat",
    version="0.1.0",
    description=("Activation rematerialization (gradient checkpointing) for "
                 "TensorFlow 2 and Keras 3 with exact gradients, in the style "
                 "of Lingvo."),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=["tfremat"],
    python_requires=">=3.10",
    install_requires=[
        "tensorflow==2.21.0",
        "numpy",
        "absl-py",
    ],
    extras_require={
        "test": ["pytest"],
        "bench": ["matplotlib"],
    },
    license="Apache-2.0",
)
