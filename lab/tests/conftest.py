# The lab's tests import tests/helpers.py (ROOT, the corpus fixtures, run_main), the flat top-level modules (the root
# conftest.py puts the repository root on sys.path) and the lab's own modules (lr_sweep, bpe_corpus) by name.
import os
import sys

LAB = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(os.path.dirname(LAB), "tests"), LAB]
