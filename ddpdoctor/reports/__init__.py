"""Reports: renderers of a Diagnosis. Each one knows nothing about the others."""
