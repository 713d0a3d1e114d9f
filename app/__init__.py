"""D3D Studio UI: layout (ui.py), plotly figures (figures.py), token colouring (tokens.py),
explanations (explain.py). Pure functions of Traces; the engine lives in d3d_core."""
