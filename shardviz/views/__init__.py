"""Views of layouts and traces: text, matplotlib, widgets, offline HTML. They read plain data only."""
