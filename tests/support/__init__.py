"""What several test modules share: tiny Hugging Face models of every supported family (model_factory), the checks of
a real local Ray Serve instance of the service (serve), and a module's command line run as its users run it (cli).
The tests import it as `support` (pytest puts tests/ on sys.path)."""
