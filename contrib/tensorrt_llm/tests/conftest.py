"""The adapter imports ``tensorrt_llm``: here that is the stand-in package (standin/)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "standin"))
sys.path.insert(0, str(Path(__file__).parent))
