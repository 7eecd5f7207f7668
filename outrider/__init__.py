"""outrider: speculative decoding for large LLMs, measured.

The public API lives in the stage modules (``assets``, ``models``, ``engine``, ``bench``,
``train``, ``export``, ``cost_model``); ``cli`` only parses arguments and calls them.
"""

__version__ = "0.1.0"
