//! Services files (placeholder, filled below).
