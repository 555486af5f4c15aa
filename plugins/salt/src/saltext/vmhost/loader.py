"""
Salt loader hooks of the installed extension.

Salt 3007 calls the functions named by the ``salt.loader`` entry points of pyproject.toml
(``module_dirs``, ``states_dirs``, ``engines_dirs``, ``runner_dirs``): each returns the directories holding
modules of that kind.
"""

import os

PKG_DIR = os.path.abspath(os.path.dirname(__file__))


def get_module_dirs():
    return [os.path.join(PKG_DIR, "modules")]


def get_states_dirs():
    return [os.path.join(PKG_DIR, "states")]


def get_engines_dirs():
    return [os.path.join(PKG_DIR, "engines")]


def get_runner_dirs():
    return [os.path.join(PKG_DIR, "runners")]
