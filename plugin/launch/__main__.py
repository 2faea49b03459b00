"""``python -m plugin.launch`` (what launch.sh runs): validate a recipe, pick a launcher, start the training."""
import sys

from .launcher import main

sys.exit(main())
