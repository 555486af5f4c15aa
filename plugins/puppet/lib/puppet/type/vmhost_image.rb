# frozen_string_literal: true

require_relative '../../puppet_x/vmhost/type_params'

Puppet::Type.newtype(:vmhost_image) do
  @doc = <<~DOC
    An image in vmhostd's images directory (`paths.images`), the file VMs boot from
    (`vmhost_vm`'s `boot => { 'image' => NAME, ... }`), verified by its sha256.

    vmhostd copies it from `source` (an http(s) URL, or a file in its import directory
    `paths.import`), checks the sha256 before the image is placed and records it
    (`image.import`); `ensure => absent` deletes it (`image.delete`), which vmhostd refuses
    while VMs boot from it. An image is never replaced: an image that is there with another
    sha256 fails (vmhostd's error 4093); delete it first or import under a new name. Every rule
    is the daemon's; the type checks only the shape of each attribute.

        vmhost_image { 'debian-12.qcow2':
          ensure => present,
          sha256 => '6a3f...e1',
          source => 'https://cloud.debian.org/images/cloud/bookworm/latest/debian-12-genericcloud-amd64.qcow2',
        }

    A `vmhost_vm` whose `boot` names an image requires (autorequire) the `vmhost_image` of
    that name when the catalog has one.
  DOC

  ensurable do
    desc <<~DOC
      `present` (default): the image is there with `sha256` (imported from `source` when it is
      not). `absent`: no file of that name (`image.delete`; refused while VMs boot from it).
    DOC

    newvalue(:present) { provider.create }
    newvalue(:absent) { provider.destroy }

    defaultto :present
  end

  PuppetX::Vmhost::TypeParams.name_param(
    self, 'The image\'s file name in `paths.images` (what `boot`\'s `image` names; vmhostd checks its form).'
  )

  newproperty(:sha256) do
    desc <<~DOC
      The image's sha256, 64 hex digits (compared in lower case). Required to import it. An
      image put there by hand has no recorded sha256: declaring it records it where it is
      (vmhostd hashes it; a file with another sha256 fails). An image recorded with another
      sha256 is never replaced: the run fails (delete it first with `ensure => absent`).
    DOC

    validate do |value|
      unless value.is_a?(String) && value.match?(/\A\h{64}\z/)
        raise ArgumentError, "sha256 must be 64 hex digits, not #{value.inspect}"
      end
    end
    munge(&:downcase)

    def change_to_s(current, desired)
      return "recorded with sha256 #{desired} (it was there without a sha256 record)" if current.nil?

      "sha256 #{current} differs from #{desired}"
    end

    def is_to_s(current) # rubocop:disable Naming/PredicateName
      current.nil? ? 'unrecorded' : super
    end
  end

  newparam(:source) do
    desc <<~DOC
      Where vmhostd copies the image from when it is not there: an `http://` or `https://` URL,
      or a file in vmhostd's import directory (`paths.import`: its name, or its absolute path
      there). Not given: the file must be in `paths.images` already (put there by hand); it is
      hashed and recorded where it is. Never compared: an image that is there with its sha256
      is as declared, wherever it came from.
    DOC

    validate do |value|
      raise ArgumentError, "source must be a non-empty string, not #{value.inspect}" unless
        value.is_a?(String) && !value.empty?
    end
  end

  newparam(:timeout_s) do
    desc <<~DOC
      The longest a download may take, in seconds (`image.import`'s `timeout_s`; vmhostd's
      default 3600). The provider waits that long plus 300 s for vmhostd's answer.
    DOC

    validate do |value|
      ok = value.is_a?(Integer) || (value.is_a?(String) && value.match?(/\A\d+\z/))
      raise ArgumentError, "timeout_s must be a whole number of seconds, not #{value.inspect}" unless ok
    end
    munge { |value| Integer(value.to_s, 10) }
  end

  PuppetX::Vmhost::TypeParams.socket_param(self)
end
