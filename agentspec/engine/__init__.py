"""The engine: draft → verify → commit for many sequences per target pass (synchronous torch code).

- ``engine.py``   the step as a numbered recipe (``Engine.step_many``) over frozen ``Plan``s
- ``sequence.py`` one request's data (``Sequence``) and engine-side state: drafting, commit, stops, stats
- ``lengths.py``  how many draft tokens a pass verifies: measured pass costs and acceptance
- ``verify.py``   verification as pure functions over a pass's flattened rows
- ``kv.py``       keys/values per sequence
- ``prefix.py``   prefix reuse across requests

The target passes it runs, and the choice among them, are ``agentspec.passes``.
"""

from .engine import Engine, Kind, Plan
from .sequence import GrammarDeadEnd, Sequence, SequenceState, StepOutput

__all__ = ["Engine", "GrammarDeadEnd", "Kind", "Plan", "Sequence", "SequenceState", "StepOutput"]
