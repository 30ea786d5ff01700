"""Kept for tools and users that run setup.py; pyproject.toml holds the
metadata."""

import setuptools

setuptools.setup()
