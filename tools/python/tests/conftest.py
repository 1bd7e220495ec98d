"""Shared fixtures: the golden vectors (loaded once) and the source tree (for the lists)."""
import pathlib

import pytest

import kvq

SOURCE_DIR = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def vectors():
    return kvq.vectors.load()


def cases_of_kind(vector_set, kind):
    return [vector_set.case(n) for n in vector_set.names() if n.startswith(kind + "/")]
