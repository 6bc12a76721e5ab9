"""Runs the store contract (tests/store_contract.py) against every store implementation it lists."""

from store_contract import *  # noqa: F401,F403  (the contract's tests and its `store` fixture)
