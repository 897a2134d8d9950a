import unittest

from stats import mean, median


class TestStats(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)

    def test_median_odd(self):
        self.assertEqual(median([3, 1, 2]), 2)

    def test_median_even(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_median_unsorted_even(self):
        self.assertEqual(median([10, 0, 5, 7, 1, 2]), 3.5)

    def test_median_single(self):
        self.assertEqual(median([7]), 7)


if __name__ == "__main__":
    unittest.main()
