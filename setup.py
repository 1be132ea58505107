"""Installs molmobot_policy with colcon (ament_python) on a ROS 2 install, or with pip. The demo
(simulated robot, demo runner) is the package in demo/: docs/decisions/demo-package.md."""
from glob import glob

from setuptools import find_packages, setup

package_name = 'molmobot_policy'

setup(
    name=package_name,
    version='0.1.0',
    packages=find_packages(include=[package_name, package_name + '.*']),
    package_data={package_name: ['runtime/*.cu']},      # built on the GPU machine at run time
    data_files=[
        ('share/ament_index/resource_index/packages', ['resource/' + package_name]),
        ('share/' + package_name, ['package.xml']),
        ('share/' + package_name + '/launch', glob('launch/*.launch.py')),
        ('share/' + package_name + '/config', glob('config/*.yaml') + glob('config/*.xml')),
    ],
    install_requires=['setuptools'],
    zip_safe=True,
    maintainer='molmobot_policy maintainers',
    maintainer_email='maintainers@molmobot-policy.invalid',
    description='ROS 2 policy node for the MolmoBot vision-language-action model',
    license='Apache-2.0',
    entry_points={
        'console_scripts': [
            'policy_node = molmobot_policy.ros.entry:main',
        ],
    },
)
