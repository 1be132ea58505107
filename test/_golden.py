"""Where the upstream golden reference data lives: `$MOLMOBOT_GOLDEN_DIR`, else
`../shared/golden/molmobot_tiny` beside the clone. Tests that need it skip without it,
naming the path they looked at."""
import os
from pathlib import Path

GOLDEN = Path(os.environ.get('MOLMOBOT_GOLDEN_DIR')
              or Path(__file__).resolve().parents[2] / 'shared' / 'golden' / 'molmobot_tiny')
MISSING = (f'golden data not found at {GOLDEN} (set MOLMOBOT_GOLDEN_DIR to the molmobot_tiny '
           f'folder of the shared golden data)')
