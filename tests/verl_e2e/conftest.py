"""The verl-e2e tier runs in .venv-verl-e2e (scripts/tiers/verl-e2e.sh); its helper modules are
imported by name (run_verl, assets), as verl's Ray workers import cpu_platform / e2e_observe."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
