"""Widget panels for the notebooks (ipywidgets, plotly)."""
