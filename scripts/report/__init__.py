"""The reporting: result files as frames, the paper's tables and figures (make tables, make figures)."""
