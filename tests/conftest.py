import os
import sys
from pathlib import Path

# Tests import the shared factories as `factories`; loraplex itself comes from the installed package.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
