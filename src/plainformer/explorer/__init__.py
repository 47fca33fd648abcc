"""The attention explorer: one self-contained HTML page of every attention weight of one sequence (`page.py`,
and its HTML, CSS and JavaScript in `static/`)."""
