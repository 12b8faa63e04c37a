"""PEP 517 backend of the attnd Python package: setuptools', plus one decision.

attnd_pb2.py is generated from attnd.proto by protoc. When no protoc is on PATH
(or $ATTND_PROTOC names none), the build asks for grpcio-tools, whose bundled
protoc does the same job; setup.py picks the generator the same way
(attnd_protoc.find_protoc), so the two never disagree.
"""
import os
import sys

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every other hook as setuptools has it)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_protoc  # noqa: E402


def _extra():
    return [] if attnd_protoc.find_protoc() else ["grpcio-tools"]


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _extra()


def get_requires_for_build_sdist(config_settings=None):
    return _setuptools.get_requires_for_build_sdist(config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _extra()
