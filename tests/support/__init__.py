"""What several test modules share: tiny Hugging Face models of every supported family (model_factory), a real local
Ray Serve instance of the service and its checks (serve), and a burst of requests sent at once (burst). The tests
import it as `support` (pytest puts tests/ on sys.path); the benchmarks that drive a burst as `tests.support`."""
